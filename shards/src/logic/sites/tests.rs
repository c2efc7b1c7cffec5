use super::*;
use proptest::prelude::*;

fn site(id: &str, scopes: &[&str]) -> Site {
    Site {
        site_id: id.into(),
        base_url: format!("http://{id}.example:8080"),
        scopes: scopes.iter().map(|s| s.to_string()).collect(),
    }
}

fn place(site: &str, model: &str, sfz: bool, warm: Option<bool>) -> Placement {
    Placement {
        site_id: site.into(),
        model: model.into(),
        kind: Kind::Chat,
        scale_from_zero: sfz,
        hold_budget: None,
        warm,
    }
}

fn map(sites: Vec<Site>, placements: Vec<Placement>) -> MapDto {
    MapDto {
        version: "1".into(),
        hints_generated_at: Some("2026-12-01T00:00:00Z".into()),
        sites,
        placements,
    }
}

#[test]
fn validation_refuses_the_whole_push_with_a_reason() {
    let good = || {
        map(
            vec![site("a", &[]), site("b", &[])],
            vec![place("b", "m", false, Some(true))],
        )
    };
    assert!(validate(good(), "a").is_ok());
    let cases: Vec<(MapDto, &str)> = vec![
        (
            MapDto {
                version: String::new(),
                ..good()
            },
            "version",
        ),
        (good(), "local site c missing"),
        (
            map(vec![site("a", &[]), site("a", &[])], vec![]),
            "duplicated",
        ),
        (map(vec![site("a b", &[])], vec![]), "site_id"),
        (
            map(
                vec![Site {
                    base_url: "ftp://x".into(),
                    ..site("a", &[])
                }],
                vec![],
            ),
            "base_url",
        ),
        (
            map(
                vec![Site {
                    base_url: "http://x/?q=1".into(),
                    ..site("a", &[])
                }],
                vec![],
            ),
            "base_url",
        ),
        (
            map(vec![site("a", &[])], vec![place("z", "m", false, None)]),
            "not a listed site",
        ),
        (
            map(
                vec![site("a", &[])],
                vec![place("a", "m", false, None), place("a", "m", true, None)],
            ),
            "duplicated",
        ),
        (
            MapDto {
                hints_generated_at: Some("yesterday".into()),
                ..good()
            },
            "RFC 3339",
        ),
    ];
    for (i, (dto, want)) in cases.into_iter().enumerate() {
        let local = if want.starts_with("local site c") {
            "c"
        } else {
            "a"
        };
        let e = validate(dto, local).expect_err(want);
        assert!(e.message().contains(want), "case {i}: {e}");
    }
    for bad in ["0s", "2h", "abc", "", "-1s", "1x"] {
        let mut d = good();
        d.placements[0].hold_budget = Some(bad.into());
        let e = validate(d, "a").expect_err(bad);
        assert!(e.message().contains("hold_budget"), "{bad}: {e}");
    }
    for ok in ["4m", "1h", "1m30s", "500ms", "0.5h"] {
        let mut d = good();
        d.placements[0].hold_budget = Some(ok.into());
        let m = validate(d, "a").expect(ok);
        assert!(m
            .placements("m", Kind::Chat)
            .all(|p| p.hold_budget.is_some()));
    }
}

#[test]
fn versions_and_freshness() {
    assert!(version_ok(None, "1"));
    assert!(
        version_ok(Some("2026-08-21T10:15:00Z"), "2026-08-21T10:15:00Z"),
        "replay"
    );
    assert!(!version_ok(
        Some("2026-08-21T10:15:01Z"),
        "2026-08-21T10:15:00Z"
    ));
    let m = validate(map(vec![site("a", &[])], vec![]), "a").expect("map");
    let t = m.hints_at.expect("hints");
    assert!(m.fresh(t + 60, 60));
    assert!(!m.fresh(t + 61, 60));
    let mut d = map(vec![site("a", &[])], vec![]);
    d.hints_generated_at = None;
    assert!(
        !validate(d, "a").expect("map").fresh(t, 60),
        "no hints: never fresh"
    );
}

#[test]
fn redirect_params_and_location() {
    assert_eq!(redirect_params("hn_redirects=1&hn_from=a"), (1, Some("a")));
    assert_eq!(
        redirect_params("hn_redirects=9"),
        (0, None),
        "invalid count"
    );
    assert_eq!(redirect_params("x=1"), (0, None));
    assert_eq!(
        strip_hn("/v1/chat/completions?hn_redirects=1&hn_from=a"),
        "/v1/chat/completions"
    );
    assert_eq!(strip_hn("/p?x=1&hn_from=a&y=2"), "/p?x=1&y=2");
    assert_eq!(strip_hn("/p?x=1"), "/p?x=1");
    assert_eq!(
        location(
            "http://b:81/",
            "/v1/chat/completions?hn_redirects=1&hn_from=c",
            2,
            "a"
        ),
        "http://b:81/v1/chat/completions?hn_redirects=2&hn_from=a"
    );
    assert_eq!(
        location("http://b:81", "/p?x=1", 1, "a"),
        "http://b:81/p?x=1&hn_redirects=1&hn_from=a"
    );
}

fn ask<'a>(identity: &'a str, fresh: bool) -> Ask<'a> {
    Ask {
        identity,
        model: "m",
        kind: Kind::Chat,
        local: "a",
        scopes: None,
        from: None,
        fresh,
    }
}

#[test]
fn choice_follows_the_rules() {
    // Two sites: b is the only sibling (always in the home set).
    let two = |warm: Option<bool>, local_sfz: bool| {
        validate(
            map(
                vec![site("a", &["eu"]), site("b", &["us"])],
                vec![
                    place("a", "m", local_sfz, None),
                    place("b", "m", false, warm),
                ],
            ),
            "a",
        )
        .expect("map")
    };
    let m = two(Some(true), true);
    assert_eq!(choose(&m, ask("k", true)), Choice::Redirect("b".into()));
    assert_eq!(
        choose(
            &m,
            Ask {
                from: Some("b"),
                ..ask("k", true)
            }
        ),
        Choice::Stay,
        "never back to hn_from (ping-pong guard)"
    );
    let eu = vec!["eu".to_string()];
    assert_eq!(
        choose(
            &m,
            Ask {
                scopes: Some(&eu),
                ..ask("k", true)
            }
        ),
        Choice::Stay,
        "b is out of the key's scope"
    );
    let cold = two(Some(false), true);
    assert_eq!(
        choose(&cold, ask("k", true)),
        Choice::HoldHere,
        "fresh, home sibling cold, holdable"
    );
    assert_eq!(
        choose(&cold, ask("k", false)),
        Choice::Redirect("b".into()),
        "stale hints redirect"
    );
    assert_eq!(
        choose(&two(Some(false), false), ask("k", true)),
        Choice::Redirect("b".into()),
        "not holdable here: redirect even to a cold sibling"
    );
    assert_eq!(
        choose(&two(None, true), ask("k", true)),
        Choice::Redirect("b".into()),
        "unknown warmth is not cold"
    );
    let only_here = validate(
        map(vec![site("a", &[])], vec![place("a", "m", true, None)]),
        "a",
    )
    .expect("map");
    assert_eq!(choose(&only_here, ask("k", true)), Choice::Stay);
}

#[test]
fn a_warm_sibling_outside_the_home_set_is_a_last_resort() {
    // Four siblings + local; find a key whose home set excludes some site.
    let ids = ["a", "b", "c", "d", "e"];
    let sites: Vec<Site> = ids.iter().map(|i| site(i, &[])).collect();
    for k in 0..200 {
        let identity = format!("key-{k}");
        let home = home_set(&identity, "m", &ids);
        if home.contains(&"a") {
            continue;
        }
        let outside = ids
            .iter()
            .find(|s| !home.contains(s) && **s != "a")
            .copied()
            .expect("one");
        let placements = ids
            .iter()
            .map(|s| {
                let warm = if home.contains(s) {
                    Some(false)
                } else {
                    Some(*s == outside)
                };
                place(s, "m", false, warm)
            })
            .collect();
        let m = validate(map(sites.clone(), placements), "a").expect("map");
        // Home siblings cold, local not holdable: the first home sibling.
        assert_eq!(
            choose(&m, ask(&identity, true)),
            Choice::Redirect(home[0].to_string())
        );
        return;
    }
    panic!("no key with the local site outside its home set");
}

proptest! {
    /// The home set is stable for a key and model, and never holds the
    /// same site twice.
    #[test]
    fn home_set_is_stable(identity in "[a-f0-9]{8,64}", model in "[a-z0-9./-]{1,40}") {
        let sites = ["a", "b", "c", "d"];
        let h1 = home_set(&identity, &model, &sites);
        let h2 = home_set(&identity, &model, &["d", "c", "b", "a"]);
        prop_assert_eq!(&h1, &h2, "order of candidates does not matter");
        prop_assert_eq!(h1.len(), 2);
        prop_assert_ne!(h1[0], h1[1]);
    }

    /// A redirect never goes to `hn_from` nor to the local site.
    #[test]
    fn never_back_to_from(identity in "[a-z0-9]{1,20}", from in 0usize..4, warm in proptest::collection::vec(proptest::option::of(any::<bool>()), 4), fresh in any::<bool>()) {
        let ids = ["a", "b", "c", "d"];
        let placements = ids.iter().zip(&warm).map(|(s, w)| place(s, "m", false, *w)).collect();
        let m = validate(map(ids.iter().map(|i| site(i, &[])).collect(), placements), "a").expect("map");
        let from = ids[from];
        if let Choice::Redirect(t) = choose(&m, Ask { from: Some(from), ..ask(&identity, fresh) }) {
            prop_assert_ne!(t.as_str(), from);
            prop_assert_ne!(t.as_str(), "a");
        }
    }
}

#[test]
fn home_sets_spread_keys_across_sites() {
    let sites = ["a", "b", "c", "d"];
    let mut member = [0u32; 4];
    for k in 0..10_000 {
        let id = format!("{:064x}", k as u128 * 0x9E37_79B9_7F4A_7C15);
        for s in home_set(&id, "meta-llama/Llama-3.1-8B-Instruct", &sites) {
            if let Some(i) = sites.iter().position(|x| *x == s) {
                member[i] += 1;
            }
        }
    }
    // Each site is in 2 of 4 home-set places: about half the keys each.
    for (i, n) in member.iter().enumerate() {
        assert!((4_500..=5_500).contains(n), "site {i}: {n} of 10000");
    }
}

#[test]
fn outside_the_home_set_only_warm_and_only_when_the_home_set_is_used_up() {
    let ids = ["a", "b", "c", "d"];
    let sites: Vec<Site> = ids.iter().map(|i| site(i, &[])).collect();
    for k in 0..200 {
        let identity = format!("key-{k}");
        let home = home_set(&identity, "m", &ids);
        if !home.contains(&"a") {
            continue;
        }
        let Some(sib) = home.iter().copied().find(|s| *s != "a") else {
            continue;
        };
        let outside: Vec<&str> = ids.iter().copied().filter(|s| !home.contains(s)).collect();
        let (warm_one, cold_one) = (outside[0], outside[1]);
        let placements = ids
            .iter()
            .map(|s| {
                let warm = if *s == warm_one {
                    Some(true)
                } else if *s == cold_one {
                    Some(false)
                } else {
                    None
                };
                place(s, "m", false, warm)
            })
            .collect();
        let m = validate(map(sites.clone(), placements), "a").expect("map");
        assert_eq!(
            choose(&m, ask(&identity, true)),
            Choice::Redirect(sib.into())
        );
        assert_eq!(
            choose(
                &m,
                Ask {
                    from: Some(sib),
                    ..ask(&identity, true)
                }
            ),
            Choice::Redirect(warm_one.into()),
            "home sibling excluded by hn_from: the warm site outside"
        );
        assert_eq!(
            choose(
                &m,
                Ask {
                    from: Some(sib),
                    ..ask(&identity, false)
                }
            ),
            Choice::Stay,
            "stale hints: nobody outside the home set is known warm"
        );
        return;
    }
    panic!("no key with the local site in its home set");
}

mod serving_here {
    use super::super::serving::{decide, Facts, LocalAgents, Serving, Sites};
    use super::*;
    use std::time::Duration;

    const DEFAULT: Duration = Duration::from_secs(60);

    fn facts<'a>(agents: LocalAgents, sites: Option<Sites<'a>>, path: &'a str) -> Facts<'a> {
        Facts {
            model: "m",
            kind: Some(Kind::Chat),
            agents,
            sites,
            identity: "key-1",
            scopes: None,
            path,
            default_budget: DEFAULT,
        }
    }

    const HEALTHY: LocalAgents = LocalAgents::Registered { healthy: true };
    const UNHEALTHY: LocalAgents = LocalAgents::Registered { healthy: false };

    #[test]
    fn without_a_map_registered_is_here_and_unknown_is_not_found() {
        let p = "/v1/chat/completions";
        assert_eq!(decide(&facts(HEALTHY, None, p)), Serving::Here);
        assert_eq!(decide(&facts(UNHEALTHY, None, p)), Serving::Here);
        assert_eq!(
            decide(&facts(LocalAgents::None, None, p)),
            Serving::NotFound
        );
    }

    #[test]
    fn a_warm_sibling_takes_it_then_a_local_hold_then_not_found() {
        let m = validate(
            map(
                vec![site("a", &[]), site("b", &[])],
                vec![
                    place("a", "m", true, None),
                    place("b", "m", false, Some(true)),
                ],
            ),
            "a",
        )
        .expect("map");
        let t = m.hints_at.expect("hints");
        let s = Sites {
            map: &m,
            local: "a",
            fresh: m.fresh(t, 60),
        };
        let p = "/v1/chat/completions?x=1";
        match decide(&facts(LocalAgents::None, Some(s), p)) {
            Serving::Redirect {
                site,
                location,
                count,
            } => {
                assert_eq!((site.as_str(), count), ("b", 1));
                assert!(location.starts_with("http://b.example:8080/v1/chat/completions?"));
                assert!(location.contains("hn_redirects=1"), "{location}");
            }
            other => panic!("expected a redirect, got {other:?}"),
        }
        // Health decides: a healthy agent here keeps it here; an
        // unhealthy pool is not served here.
        assert_eq!(decide(&facts(HEALTHY, Some(s), p)), Serving::Here);
        assert!(matches!(
            decide(&facts(UNHEALTHY, Some(s), p)),
            Serving::Redirect { .. }
        ));
        // Out of hops: held here (the placement has scale_from_zero).
        let spent = "/v1/chat/completions?hn_redirects=2";
        assert_eq!(
            decide(&facts(LocalAgents::None, Some(s), spent)),
            Serving::Hold(DEFAULT)
        );
        // count_tokens is never redirected nor held.
        let ct = Facts {
            kind: None,
            ..facts(LocalAgents::None, Some(s), p)
        };
        assert_eq!(decide(&ct), Serving::NotFound);
        // Never back to the site that sent it: held here instead.
        let back = "/v1/chat/completions?hn_redirects=1&hn_from=b";
        assert_eq!(
            decide(&facts(LocalAgents::None, Some(s), back)),
            Serving::Hold(DEFAULT)
        );
    }

    #[test]
    fn cold_siblings_mean_a_hold_with_the_placements_budget() {
        let mut here = place("a", "m", true, None);
        here.hold_budget = Some("2m".into());
        let m = validate(
            map(
                vec![site("a", &[]), site("b", &[])],
                vec![here, place("b", "m", false, Some(false))],
            ),
            "a",
        )
        .expect("map");
        let t = m.hints_at.expect("hints");
        let s = Sites {
            map: &m,
            local: "a",
            fresh: m.fresh(t, 60),
        };
        let p = "/v1/chat/completions";
        assert_eq!(
            decide(&facts(LocalAgents::None, Some(s), p)),
            Serving::Hold(Duration::from_secs(120))
        );
        // Not placed here with scale_from_zero: a registered pool stays
        // with its owner (503), an unknown model is not found.
        let m2 = validate(
            map(
                vec![site("a", &[]), site("b", &[])],
                vec![place("b", "m", false, Some(false))],
            ),
            "a",
        )
        .expect("map");
        let s2 = Sites { map: &m2, ..s };
        // Stale hints: b is still sent to (unknown warmth is sendable).
        let stale = Sites { fresh: false, ..s2 };
        assert!(matches!(
            decide(&facts(LocalAgents::None, Some(stale), p)),
            Serving::Redirect { .. }
        ));
        let spent = "/v1/chat/completions?hn_redirects=2";
        assert_eq!(decide(&facts(UNHEALTHY, Some(s2), spent)), Serving::Here);
        assert_eq!(
            decide(&facts(LocalAgents::None, Some(s2), spent)),
            Serving::NotFound
        );
    }
}

/// Issue 29 #12: base URLs of visible ASCII only; whatever the client's
/// target holds reaches `Location` percent-encoded.
#[test]
fn base_urls_are_plain_ascii_and_locations_are_encoded() {
    for bad in [
        "http://b\r\nX-Evil: 1",
        "http://bé.example",
        "http://b\u{1}",
        "http://u@b",
        "https://",
    ] {
        assert!(!valid_base_url(bad), "{bad:?} accepted");
    }
    assert!(valid_base_url("https://b.example:8443/base/"));
    let l = location("http://b:81/", "/p?q=a b\"<\u{e9}>%41", 1, "a");
    assert_eq!(
        l,
        "http://b:81/p?q=a%20b%22%3C%C3%A9%3E%41&hn_redirects=1&hn_from=a"
    );
    assert!(l.bytes().all(|b| (0x21..=0x7e).contains(&b)), "{l}");
}
