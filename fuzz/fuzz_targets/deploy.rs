//! Deploy validation on arbitrary bytes: a deploy must refuse (or accept)
//! every upload with an error, never panic, hang or exhaust memory.
#![no_main]

use std::sync::LazyLock;

use fief::fuzz::DeployValidator;
use libfuzzer_sys::fuzz_target;

static VALIDATOR: LazyLock<DeployValidator> =
    LazyLock::new(|| DeployValidator::new().expect("the engine starts"));

fuzz_target!(|data: &[u8]| {
    let _ = VALIDATOR.validate(data);
});
