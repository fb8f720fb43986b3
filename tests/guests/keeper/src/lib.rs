//! `keeper`: a test guest whose whole state is one blob that it hands off,
//! to test that handoff states of any size arrive intact (contract §5 row 8:
//! "handoff state arrives").
//!
//! | command          | reply                                                   |
//! |------------------|---------------------------------------------------------|
//! | `set <n> <byte>` | `ok`, after making the state `n` copies of `<byte>` (its first character) |
//! | `get`            | `<length> <sum>`: the state's length and the wrapping sum of its bytes |
//! | `moves`          | how many handoffs this state has come through           |
//!
//! `handoff` returns the state as it is, with an 8-byte count of the
//! handoffs it came through in front; `init` takes it back. A key that never
//! had a state hands off an empty one.

use fief_guest::{Key, export_key};

/// One key's state.
struct Keeper {
    /// The blob.
    state: Vec<u8>,
    /// Handoffs this state came through.
    moves: u64,
}

impl Keeper {
    fn command(&mut self, text: &str) -> Result<String, String> {
        let mut words = text.split(' ');
        match (words.next(), words.next(), words.next()) {
            (Some("set"), Some(n), Some(byte)) => {
                let n: usize = n
                    .parse()
                    .map_err(|_| format!("keeper: set needs a length, got {n:?}"))?;
                let byte = *byte.as_bytes().first().ok_or("keeper: set needs a byte")?;
                self.state = vec![byte; n];
                Ok("ok".to_owned())
            }
            (Some("get"), None, None) => {
                let sum = self
                    .state
                    .iter()
                    .fold(0u32, |sum, b| sum.wrapping_add(u32::from(*b)));
                Ok(format!("{} {sum}", self.state.len()))
            }
            (Some("moves"), None, None) => Ok(self.moves.to_string()),
            _ => Err(format!(
                "keeper: unknown command {text:?}; expected set <n> <byte>, get or moves"
            )),
        }
    }
}

impl Key for Keeper {
    fn init(_key: &str, handoff: Option<Vec<u8>>) -> Result<Self, String> {
        let Some(bytes) = handoff else {
            return Ok(Keeper {
                state: Vec::new(),
                moves: 0,
            });
        };
        let (moves, state) = bytes
            .split_first_chunk::<8>()
            .ok_or("keeper: a handoff state shorter than its 8-byte header")?;
        Ok(Keeper {
            state: state.to_vec(),
            moves: u64::from_le_bytes(*moves) + 1,
        })
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        let text = String::from_utf8_lossy(&message);
        self.command(&text).map(String::into_bytes)
    }

    fn handoff(&mut self) -> Option<Vec<u8>> {
        let mut bytes = Vec::with_capacity(8 + self.state.len());
        bytes.extend_from_slice(&self.moves.to_le_bytes());
        bytes.extend_from_slice(&self.state);
        Some(bytes)
    }
}

export_key!(Keeper);
