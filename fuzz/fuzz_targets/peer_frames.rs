//! The node-to-node frame decoder on arbitrary bytes, as a peer could send
//! them: length-delimited frames decoded with postcard; every frame that
//! decodes must survive encoding again.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fief::fuzz::peer_frames(data);
});
