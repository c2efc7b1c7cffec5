//! What a map writer or a client hands the sites code never panics: a
//! sibling-map push (an accepted map lists the local site and every
//! placement's site; the choice for any model never names hn_from or the
//! local site), Go durations, and redirect query strings (the stripped
//! target keeps no hn_ parameter).
#![no_main]
use libfuzzer_sys::fuzz_target;
use shards::logic::sites::{self, Choice};

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 3 {
        0 => {
            let Ok(dto) = serde_json::from_slice::<sites::MapDto>(rest) else {
                return;
            };
            let Ok(map) = sites::validate(dto, "a") else {
                return;
            };
            assert!(map.site("a").is_some());
            for p in &map.dto.placements {
                assert!(map.site(&p.site_id).is_some());
                for from in [None, Some("b")] {
                    let ask = sites::Ask {
                        identity: "k",
                        model: &p.model,
                        kind: p.kind,
                        local: "a",
                        scopes: None,
                        from,
                        fresh: which & 0x80 != 0,
                    };
                    if let Choice::Redirect(t) = sites::choose(&map, ask) {
                        assert_ne!(t, "a");
                        assert_ne!(Some(t.as_str()), from);
                    }
                }
            }
        }
        1 => {
            if let Ok(s) = std::str::from_utf8(rest) {
                let _ = sites::parse_go_duration(s);
            }
        }
        _ => {
            if let Ok(s) = std::str::from_utf8(rest) {
                let _ = sites::redirect_params(s);
                let stripped = sites::strip_hn(s);
                if let Some((_, q)) = stripped.split_once('?') {
                    assert!(!q.split('&').any(|p| p.starts_with("hn_")), "{stripped}");
                }
            }
        }
    }
});
