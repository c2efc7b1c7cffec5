//! The policy YAML loader never panics; an accepted policy has a primary
//! step and an error names its file.
#![no_main]
use libfuzzer_sys::fuzz_target;
use shards::logic::routing::policy;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match policy::parse("fuzz.yaml", text) {
        Ok(p) => assert!(!p.steps.is_empty()),
        Err(e) => assert_eq!(e.file, "fuzz.yaml"),
    }
});
