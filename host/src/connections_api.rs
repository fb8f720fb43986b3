//! The `fief:key/connections` imports: what a key sends to its WebSocket
//! connections, closes, and lists (`docs/realtime.md`).
//!
//! A frame goes to the socket if this node holds it, else to the outbox of
//! the node that does (`connections.rs`), whose feed carries it in order.
//! Like every effect it passes the gate first, and while the callback holds
//! uncommitted storage writes it is held until they commit (the output
//! gate), as casts and publications are. This file must not do I/O.

use crate::bindings::connections::Host;
use crate::bindings::types::EffectError;
use crate::connections::key_close_code;
use crate::key::{KeyCtx, KeyServices, Output};
use crate::wire::ConnSend;

/// Longest close reason a WebSocket close frame carries, in bytes.
const MAX_CLOSE_REASON: usize = 123;

impl Host for KeyCtx {
    fn send_text(&mut self, id: u64, text: String) -> wasmtime::Result<Result<(), EffectError>> {
        let bytes = text.len();
        self.charged(bytes, |ctx| ctx.send_frame(ConnSend::Text { id, text }))
    }

    fn send_binary(&mut self, id: u64, data: Vec<u8>) -> wasmtime::Result<Result<(), EffectError>> {
        let bytes = data.len();
        self.charged(bytes, |ctx| ctx.send_frame(ConnSend::Binary { id, data }))
    }

    fn close(&mut self, id: u64, code: u16, reason: String) -> wasmtime::Result<()> {
        let bytes = reason.len();
        self.charged(bytes, |ctx| {
            let reason = crate::guest_log::bounded(reason, MAX_CLOSE_REASON);
            let close = ConnSend::Close {
                id,
                code: key_close_code(code),
                reason,
            };
            // Closing a connection the key does not have is no effect.
            let _ = ctx.send_frame(close)?;
            Ok(())
        })
    }

    fn list_connections(&mut self) -> wasmtime::Result<Vec<u64>> {
        let services = self.gate()?;
        Ok(services
            .connections
            .attached
            .list(&self.env.module, &self.env.key))
    }
}

impl KeyCtx {
    /// Send (or hold for the commit) one frame or close.
    fn send_frame(&mut self, send: ConnSend) -> wasmtime::Result<Result<(), EffectError>> {
        let services = self.gate()?;
        let limit = services.config.max_message_size.as_u64() as usize;
        if send.bytes() > limit {
            return Ok(Err(EffectError::Limit(format!(
                "a frame of {} bytes is over max_message_size ({limit} bytes)",
                send.bytes()
            ))));
        }
        if self.storage.holding() {
            // Checked now, sent once the callback's writes are committed.
            if !services.connections.attached.is_attached(
                &self.env.module,
                &self.env.key,
                send.id(),
            ) {
                return Ok(Err(no_such_connection(send.id())));
            }
            let bytes = send.bytes();
            return Ok(self
                .storage
                .hold(Output::Connection(send), bytes)
                .map_err(|refusal| EffectError::Limit(refusal.to_string())));
        }
        Ok(send_now(self, &services, send))
    }
}

/// Send `send` now: to the socket if this node holds it, else to the
/// outbox of the node that does.
pub(crate) fn send_now(
    ctx: &KeyCtx,
    services: &KeyServices,
    send: ConnSend,
) -> Result<(), EffectError> {
    let connections = &services.connections;
    let Some(via) = connections
        .attached
        .via(&ctx.env.module, &ctx.env.key, send.id())
    else {
        return Err(no_such_connection(send.id()));
    };
    let sent = if *via == *services.node_id.as_str() {
        connections.sockets.send(send)
    } else {
        connections.outbox.push(&via, send)
    };
    if sent {
        Ok(())
    } else {
        Err(EffectError::Overloaded)
    }
}

fn no_such_connection(id: u64) -> EffectError {
    EffectError::Invalid(format!(
        "connection {id} is not attached to this key (it closed, or never was): \
         `list-connections` names the open ones"
    ))
}
