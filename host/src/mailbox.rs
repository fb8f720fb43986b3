//! A key process's mailbox: a bounded queue of [`Envelope`]s whose payloads
//! are charged to the key's host-memory ledger ([`crate::host_bytes`]) while
//! they wait.
//!
//! Two bounds hold at once: `mailbox_depth` messages, and the key's (and its
//! tenant's) host bytes. A message that would pass either is refused at the
//! door, so the sender can answer its caller; nothing already queued is
//! dropped. The charge travels inside the queue
//! with its envelope and is given back when the key task takes the message
//! out, or when the mailbox is dropped with messages still in it.
//!
//! It must not decide what a refusal means for the sender (an error to a
//! caller, a missed publication, a dropped timer): that is the sender's.

use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::mpsc;

use crate::error::Error;
use crate::host_bytes::{Held, Ledger, Refusal};
use crate::key::Envelope;

/// An envelope in the queue, with the bytes it holds.
///
/// Queued boxed: tokio's channel allocates its first block of 32 slots
/// when it is made, and every live key has a mailbox, most of them empty
/// (a call to an idle key runs inline, without it). Slots of 8 bytes
/// instead of 80 save 2.3 KiB per live key, for one allocation per
/// message that does wait in a mailbox.
struct Mail {
    envelope: Envelope,
    _held: Held,
}

impl Mail {
    /// The envelope, out of its box; its bytes are given back.
    fn into_envelope(self) -> Envelope {
        let Mail { envelope, _held } = self;
        envelope
    }
}

/// The sending side of a key's mailbox (cheap to clone).
#[derive(Clone)]
pub(crate) struct Mailbox {
    tx: mpsc::Sender<Box<Mail>>,
    ledger: Arc<Ledger>,
}

/// A mailbox that does not keep the key's queue open (timers and pub/sub
/// hold these, so a dead key's queue closes).
#[derive(Clone)]
pub(crate) struct WeakMailbox {
    tx: mpsc::WeakSender<Box<Mail>>,
    ledger: Arc<Ledger>,
}

/// The key task's side.
pub(crate) struct MailboxRx {
    rx: mpsc::Receiver<Box<Mail>>,
}

/// Why an envelope was not queued (dropped, except from a closed mailbox,
/// whose envelope may go to the key's next process).
pub(crate) enum Refused {
    /// `mailbox_depth` messages are waiting.
    Full,
    /// The key process is gone; the envelope is handed back.
    Closed(Envelope),
    /// The key or its tenant holds too many host bytes.
    Memory(Refusal),
}

impl Refused {
    /// The error for the caller of `module`/`key` whose envelope `tx`
    /// refused (the envelope is dropped). A closed mailbox reads as a full
    /// one: the key is going away, and a retry reaches its next process.
    pub(crate) fn into_error(self, module: &str, key: &str, tx: &Mailbox) -> Error {
        match self {
            Refused::Memory(refusal) => Error::HostMemory {
                module: module.to_owned(),
                key: key.to_owned(),
                refusal,
            },
            Refused::Full | Refused::Closed(_) => Error::Overloaded {
                module: module.to_owned(),
                key: key.to_owned(),
                depth: tx.max_capacity(),
            },
        }
    }
}

/// A new mailbox of `depth` messages charging `ledger`.
pub(crate) fn channel(depth: usize, ledger: Arc<Ledger>) -> (Mailbox, MailboxRx) {
    let (tx, rx) = mpsc::channel(depth);
    (Mailbox { tx, ledger }, MailboxRx { rx })
}

impl Mailbox {
    /// Queue `envelope` now, charging its payload, or refuse it.
    pub(crate) fn try_send(&self, envelope: Envelope) -> Result<(), Refused> {
        let held = match self.ledger.hold(envelope.payload_bytes()) {
            Ok(held) => held,
            Err(refusal) => return Err(Refused::Memory(refusal)),
        };
        self.try_send_held(envelope, held)
    }

    /// Queue `envelope` now with bytes already charged for it (a timer's tag).
    pub(crate) fn try_send_held(&self, envelope: Envelope, held: Held) -> Result<(), Refused> {
        self.tx
            .try_send(Box::new(Mail {
                envelope,
                _held: held,
            }))
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => Refused::Full,
                mpsc::error::TrySendError::Closed(mail) => Refused::Closed((*mail).into_envelope()),
            })
    }

    /// Queue `envelope`, waiting for room; its bytes are not charged (a stop
    /// order, which must not be refused). Hands it back if the key is gone.
    pub(crate) async fn send_uncharged(&self, envelope: Envelope) -> Result<(), Envelope> {
        let mail = Box::new(Mail {
            envelope,
            _held: Held::none(),
        });
        self.tx.send(mail).await.map_err(|e| (*e.0).into_envelope())
    }

    /// The ledger the mailbox charges (the key process's).
    pub(crate) fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// Messages that fit now.
    pub(crate) fn capacity(&self) -> usize {
        self.tx.capacity()
    }

    /// `mailbox_depth`.
    pub(crate) fn max_capacity(&self) -> usize {
        self.tx.max_capacity()
    }

    /// A handle that does not keep the queue open.
    pub(crate) fn downgrade(&self) -> WeakMailbox {
        WeakMailbox {
            tx: self.tx.downgrade(),
            ledger: self.ledger.clone(),
        }
    }
}

impl WeakMailbox {
    /// The mailbox, if its key process still runs.
    pub(crate) fn upgrade(&self) -> Option<Mailbox> {
        Some(Mailbox {
            tx: self.tx.upgrade()?,
            ledger: self.ledger.clone(),
        })
    }

    /// The ledger of the key process.
    pub(crate) fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }
}

impl MailboxRx {
    /// Poll for the next envelope; its bytes are given back as it leaves.
    pub(crate) fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Envelope>> {
        self.rx
            .poll_recv(cx)
            .map(|m| m.map(|mail| (*mail).into_envelope()))
    }

    /// The next envelope, if one is waiting.
    pub(crate) fn try_recv(&mut self) -> Result<Envelope, mpsc::error::TryRecvError> {
        self.rx.try_recv().map(|mail| (*mail).into_envelope())
    }

    /// Whether nothing is waiting.
    pub(crate) fn is_empty(&self) -> bool {
        self.rx.is_empty()
    }

    /// Refuse new messages; those queued can still be taken.
    pub(crate) fn close(&mut self) {
        self.rx.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every live key has a mailbox, and tokio allocates a mailbox's first
    /// block of 32 slots when it is made, empty or not: a slot must stay one
    /// pointer (2.6 KiB per key with the envelope inline; 0.3 KiB boxed).
    #[test]
    fn a_mailbox_slot_is_one_pointer() {
        assert_eq!(
            std::mem::size_of::<Box<Mail>>(),
            std::mem::size_of::<usize>()
        );
        // What the box saves: the envelope and its charge inline.
        assert!(std::mem::size_of::<Mail>() >= 64);
    }

    /// A queued envelope holds its bytes until it is taken out of its box;
    /// one refused by a closed mailbox comes back, its bytes given back.
    #[test]
    fn a_closed_mailbox_hands_the_envelope_back_and_releases_its_bytes() {
        let tenant = Ledger::tenant("t", 1 << 20);
        let ledger = Ledger::key(&tenant, 1 << 20);
        let (tx, mut rx) = channel(4, ledger.clone());
        let cast = |m: &[u8]| Envelope::Cast {
            message: m.to_vec(),
            trace: None,
        };
        assert!(tx.try_send(cast(b"queued")).is_ok());
        assert_eq!(
            ledger.used(),
            6 + crate::host_bytes::MESSAGE_OVERHEAD,
            "a queued message holds its bytes"
        );
        match rx.try_recv() {
            Ok(Envelope::Cast { message, .. }) => assert_eq!(message, b"queued"),
            _ => panic!("the queued message did not come out"),
        }
        assert_eq!(ledger.used(), 0, "a taken message gives its bytes back");
        drop(rx);
        match tx.try_send(cast(b"hello")) {
            Err(Refused::Closed(Envelope::Cast { message, .. })) => assert_eq!(message, b"hello"),
            _ => panic!("a closed mailbox took the envelope"),
        }
        assert_eq!(ledger.used(), 0);
        assert_eq!(tenant.used(), 0);
    }
}
