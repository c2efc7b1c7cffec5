//! Agent-link codecs: the preamble, the control-stream frames and the
//! multistream-select prelude the agent reads never panic on any input,
//! and what decodes encodes back to the same value.
#![no_main]
use libfuzzer_sys::fuzz_target;
use shards::logic::link::{control, multistream, preamble};

fuzz_target!(|data: &[u8]| {
    if let Ok(Some((model, used))) = preamble::decode(data) {
        assert!(used <= data.len());
        let again = preamble::encode(&model);
        assert_eq!(
            preamble::decode(&again).ok().flatten().map(|(m, _)| m),
            Some(model)
        );
    }
    if let Ok(Some((msg, used))) = control::decode(data) {
        assert!(used <= data.len());
        let bytes = control::encode(&msg);
        let (again, n) = control::decode(&bytes)
            .expect("ours decodes")
            .expect("complete");
        assert_eq!(n, bytes.len());
        assert_eq!(format!("{again:?}"), format!("{msg:?}"));
    }
    if let multistream::Prelude::Selected { consumed } = multistream::parse_prelude(data, "/http/1.1") {
        assert!(consumed <= data.len());
        assert_eq!(
            data.get(..consumed),
            Some(multistream::confirmation("/http/1.1").as_slice())
        );
    }
});
