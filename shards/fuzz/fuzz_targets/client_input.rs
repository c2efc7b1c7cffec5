//! What a client or an operator hands the router about keys never panics:
//! `auth.yaml` (an accepted file has an owner per key and errors are one
//! line naming the file), request bodies through the probe and the alias
//! rewrite (a rewritten body still carries the new model), and the dynamic
//! registry's JSON.
#![no_main]
use libfuzzer_sys::fuzz_target;
use shards::logic::http::api::probe;
use shards::logic::tenancy::{auth, registry};

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 3 {
        0 => {
            let Ok(text) = std::str::from_utf8(rest) else {
                return;
            };
            match auth::parse_config("fuzz.yaml", text) {
                Ok(c) => assert!(c.keys.iter().all(|(_, k)| !k.tenant.is_empty())),
                Err(e) => assert!(e.message().contains("fuzz.yaml") && !e.message().contains('\n'), "{e}"),
            }
        }
        1 => {
            let _ = probe::probe(rest);
            if let Some(out) = probe::replace_model(rest, "resolved/model") {
                if probe::probe(rest).is_ok() {
                    let m = probe::probe(&out).map(|m| m.model);
                    assert_eq!(m.as_deref(), Ok("resolved/model"));
                }
            }
        }
        _ => {
            if let Ok(dto) = serde_json::from_slice::<registry::KeyDto>(rest) {
                let mut r = registry::Registry::default();
                let _ = r.put("id", dto);
            }
        }
    }
});
