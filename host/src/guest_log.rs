//! Guest stdout and stderr, turned into log lines tagged with the key.
//!
//! A key's WASI stdout and stderr are not the node's: each is a
//! [`GuestLog`] that splits what the guest writes into lines and emits each as
//! a `tracing` event with the module and key, so a guest's `println!` shows up
//! in the node's log attributed to it. A line longer than [`MAX_LINE`] is
//! emitted in pieces, so a guest cannot make the host buffer without bound.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};

/// Longest line buffered before it is emitted anyway.
pub const MAX_LINE: usize = 8 * 1024;

/// Which stream a [`GuestLog`] stands for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Stream {
    Stdout,
    Stderr,
}

/// A guest's stdout or stderr, writing to the node's log.
#[derive(Clone)]
pub(crate) struct GuestLog {
    module: Arc<str>,
    key: Arc<str>,
    stream: Stream,
}

impl GuestLog {
    pub(crate) fn new(module: Arc<str>, key: Arc<str>, stream: Stream) -> Self {
        GuestLog {
            module,
            key,
            stream,
        }
    }
}

impl IsTerminal for GuestLog {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for GuestLog {
    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(LineWriter {
            target: self.clone(),
            line: Vec::new(),
        })
    }
}

struct LineWriter {
    target: GuestLog,
    line: Vec<u8>,
}

impl LineWriter {
    fn emit(&mut self) {
        let text = String::from_utf8_lossy(&self.line);
        let (module, key) = (&*self.target.module, &*self.target.key);
        match self.target.stream {
            Stream::Stdout => {
                tracing::info!(target: "fief::guest", module, key, stream = "stdout", "{text}")
            }
            Stream::Stderr => {
                tracing::warn!(target: "fief::guest", module, key, stream = "stderr", "{text}")
            }
        }
        self.line.clear();
    }
}

impl AsyncWrite for LineWriter {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        for &byte in buf {
            if byte == b'\n' {
                self.emit();
            } else {
                self.line.push(byte);
                if self.line.len() >= MAX_LINE {
                    self.emit();
                }
            }
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.line.is_empty() {
            self.emit();
        }
        Poll::Ready(Ok(()))
    }
}

impl Drop for LineWriter {
    fn drop(&mut self) {
        if !self.line.is_empty() {
            self.emit();
        }
    }
}
