//! Entry points for the fuzz targets in `fuzz/` (cargo-fuzz) and for the
//! stable test that replays their seed corpus: the two parsers of bytes an
//! outsider controls — deploy validation of an uploaded component, and the
//! node-to-node frame decoder. Each entry point must return (an error is
//! fine) for every input: a panic, a hang or unbounded memory is a bug.
//! How to run them: `docs/testing.md`, "Fuzzing".

use bytes::BytesMut;
use tokio_util::codec::Decoder;

use crate::config::{ByteSize, ModuleOptions, NodeConfig};
use crate::error::Result;
use crate::module::compile;
use crate::runtime::Runtime;
use crate::wire::{codec, decode_frame, encode};

/// Largest frame payload the frame target accepts (a node's
/// `max_message_size` plus the frame overhead, as on a real connection).
const FUZZ_MAX_MESSAGE: usize = 64 * 1024;

/// Deploy validation with a node's engine and linker, built once.
pub struct DeployValidator {
    runtime: Runtime,
}

impl DeployValidator {
    /// An engine and linker configured as a small node's.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Config`] if the engine cannot be created.
    pub fn new() -> Result<Self> {
        let config = NodeConfig {
            max_live_keys: 4,
            max_memory_per_key: ByteSize::mib(16),
            ..NodeConfig::default()
        };
        Ok(DeployValidator {
            runtime: Runtime::new(&config)?,
        })
    }

    /// Validate and compile `bytes` exactly as a deploy does, before
    /// anything is stored. `Err` is the deploy's refusal.
    ///
    /// # Errors
    ///
    /// [`crate::Error::InvalidModule`] saying what is wrong with the bytes.
    pub fn validate(&self, bytes: &[u8]) -> Result<()> {
        compile(&self.runtime, bytes, ModuleOptions::default(), 1).map(drop)
    }
}

/// Feed `data` to a peer connection's decoder as if a peer had sent it:
/// split it into length-delimited frames, decode each, and check that a
/// frame that decodes encodes back to bytes that decode to the same
/// encoding. Returns how many frames decoded.
///
/// # Panics
///
/// When a decoded frame does not survive encoding again (a bug in the
/// frame types), which is what the fuzzer looks for besides crashes.
pub fn peer_frames(data: &[u8]) -> usize {
    let mut codec = codec(FUZZ_MAX_MESSAGE);
    let mut buffer = BytesMut::from(data);
    let mut decoded = 0;
    // The codec refuses an oversized length prefix with an error, which
    // ends the connection; so does the first undecodable frame.
    while let Ok(Some(frame)) = codec.decode(&mut buffer) {
        let Ok(frame) = decode_frame(&frame) else {
            break;
        };
        decoded += 1;
        let once = encode(&frame).expect("a decoded frame encodes");
        let again = decode_frame(&once).expect("an encoded frame decodes");
        let twice = encode(&again).expect("a decoded frame encodes");
        assert_eq!(once, twice, "a frame changed across encode and decode");
    }
    decoded
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    /// The seed corpus of a fuzz target, `fuzz/corpus/<target>/*`.
    fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../fuzz/corpus")
            .join(target);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .map(|entry| entry.unwrap().path())
            .collect();
        files.sort();
        files
            .into_iter()
            .map(|path| {
                let bytes = std::fs::read(&path).unwrap();
                (path, bytes)
            })
            .collect()
    }

    /// The stable stand-in for a fuzz run: every seed (and every prefix of
    /// the small ones) goes through the target without a panic.
    #[test]
    fn the_peer_frame_corpus_decodes_without_panicking() {
        let seeds = corpus("peer_frames");
        assert!(!seeds.is_empty());
        let mut decoded = 0;
        for (_, bytes) in seeds {
            decoded += peer_frames(&bytes);
            for cut in 0..bytes.len().min(256) {
                peer_frames(&bytes[..cut]);
            }
        }
        assert!(decoded > 0, "at least one seed is a valid frame");
    }

    #[test]
    fn the_deploy_corpus_validates_without_panicking() {
        let validator = DeployValidator::new().unwrap();
        for (path, bytes) in corpus("deploy") {
            // Refused or accepted, never a panic.
            let _ = validator.validate(&bytes);
            for cut in [0, 1, 4, 8, 9, bytes.len() / 2] {
                let cut = cut.min(bytes.len());
                assert!(
                    validator.validate(&bytes[..cut]).is_err() || cut == bytes.len(),
                    "a truncated {} was accepted",
                    path.display()
                );
            }
        }
    }
}
