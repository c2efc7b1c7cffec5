use super::*;
use proptest::prelude::*;

const H1: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
const H2: &str = "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752";

fn cfg(keys: &str) -> Result<AuthConfig, String> {
    parse_config(
        "auth.yaml",
        &format!("api:\n  mode: api-key\n  keys:\n{keys}"),
    )
    .map_err(String::from)
}

#[test]
fn bearer_extraction() {
    assert_eq!(bearer_token(Some(b"Bearer sk-1"), None), Some(&b"sk-1"[..]));
    assert_eq!(bearer_token(Some(b"  sk-1 "), None), Some(&b"sk-1"[..]));
    assert_eq!(bearer_token(Some(b"Bearer   "), None), None);
    assert_eq!(bearer_token(None, Some(b"sk-2")), Some(&b"sk-2"[..]));
    assert_eq!(bearer_token(Some(b""), Some(b"sk-2")), Some(&b"sk-2"[..]));
    // Authorization wins when both are there.
    assert_eq!(bearer_token(Some(b"Bearer a"), Some(b"b")), Some(&b"a"[..]));
    assert_eq!(bearer_token(None, None), None);
    // `bearer ` in another case is not stripped: the whole value is the token.
    assert_eq!(
        bearer_token(Some(b"bearer x"), None),
        Some(&b"bearer x"[..])
    );
}

#[test]
fn a_complete_file_parses() {
    let c = cfg(&format!(
        r#"    - key_hash: "{H1}"
      key_preview: "sk-...KJ4"
      metadata: {{name: "Acme prod", owner: acme, description: "", created_at: "27-07-2026", expires_at: "01-01-2027"}}
      models: [m1]
      quota: {{requests_per_minute: 100, tokens_per_day: 500000}}
    - key_hash: "{}"
      metadata: {{name: b, owner: beta}}
      quota:
        per_model:
          m2: {{requests_per_minute_per_replica: 10, tokens_per_day: 0}}
      max_occupancy_share: 0.25
"#,
        H2.to_uppercase()
    ))
    .expect("valid");
    assert_eq!(c.api, ApiMode::ApiKey);
    assert_eq!(c.keys.len(), 2);
    let (h, k) = &c.keys[0];
    assert_eq!(hex(h), H1);
    assert_eq!(&*k.tenant, "acme");
    assert_eq!(
        k.limits,
        Limits::Flat {
            rpm: 100,
            tpd: 500_000,
            itpm: 0,
            otpm: 0
        }
    );
    assert_eq!(k.key_id.len(), 3 + 16);
    // Valid through 01-01-2027 UTC, not at 00:00 on the 2nd.
    let jan2 = parse_rfc3339("2027-01-02T00:00:00Z").expect("date");
    assert_eq!(k.expires_at, Some(jan2));
    assert!(k.valid_at(jan2 - 1));
    assert!(!k.valid_at(jan2));
    assert_eq!(k.access("m1"), Access::Allowed);
    assert_eq!(k.access("m9"), Access::Forbidden);
    let (h2, k2) = &c.keys[1];
    // Uppercase hashes are normalised (better than the spec: they matched nothing).
    assert_eq!(hex(h2), H2);
    assert_eq!(k2.access("m2"), Access::Allowed);
    assert_eq!(k2.access("m1"), Access::Undeclared);
    assert!((k2.max_occupancy_share - 0.25).abs() < 1e-9);
}

#[test]
fn every_invalid_entry_is_refused_with_its_field() {
    let cases: Vec<(String, &str)> = vec![
        ("    - metadata: {name: a, owner: b}\n".into(), "api.keys[0].key_hash: required"),
        (format!("    - key_hash: \"{H1}\"\n      metadata: {{owner: b}}\n"), "metadata.name"),
        (format!("    - key_hash: \"{H1}\"\n      metadata: {{name: a}}\n"), "metadata.owner"),
        ("    - key_hash: \"abc\"\n      metadata: {name: a, owner: b}\n".into(), "64 hex"),
        (format!("    - key_hash: \"{H1}\"\n      metadata: {{name: a, owner: b}}\n    - key_hash: \"{H1}\"\n      metadata: {{name: a, owner: b}}\n"), "api.keys[1].key_hash: duplicate"),
        (format!("    - key_hash: \"{H1}\"\n      metadata: {{name: a, owner: b, expires_at: \"2027-01-01\"}}\n"), "expires_at"),
        (format!("    - key_hash: \"{H1}\"\n      metadata: {{name: a, owner: b, expires_at: \"31-02-2027\"}}\n"), "expires_at"),
        (format!("    - key_hash: \"{H1}\"\n      metadata: {{name: a, owner: b}}\n      quota: {{requests_per_minute: -1}}\n"), "requests_per_minute: must be >= 0"),
        (format!("    - key_hash: \"{H1}\"\n      metadata: {{name: a, owner: b}}\n      quota: {{tokens_per_day: 5, per_model: {{m: {{requests_per_minute_per_replica: 1, tokens_per_day: 1}}}}}}\n"), "cannot be combined"),
        (format!("    - key_hash: \"{H1}\"\n      metadata: {{name: a, owner: b}}\n      quota: {{per_model: {{}}}}\n"), "at least one model"),
        (format!("    - key_hash: \"{H1}\"\n      metadata: {{name: a, owner: b}}\n      quota: {{per_model: {{m: {{tokens_per_day: 1}}}}}}\n"), "per_model.m.requests_per_minute_per_replica: required"),
        (format!("    - key_hash: \"{H1}\"\n      metadata: {{name: a, owner: b}}\n      quota: {{per_model: {{m: {{requests_per_minute_per_replica: -2, tokens_per_day: 1}}}}}}\n"), ">= 0"),
        (format!("    - key_hash: \"{H1}\"\n      metadata: {{name: a, owner: b}}\n      quota: {{per_model: {{\"\": {{requests_per_minute_per_replica: 1, tokens_per_day: 1}}}}}}\n"), "empty model name"),
        (format!("    - key_hash: \"{H1}\"\n      metadata: {{name: a, owner: b}}\n      max_occupancy_share: 1.5\n"), "max_occupancy_share"),
        (format!("    - key_hash: \"{H1}\"\n      metadata: {{name: a, owner: b}}\n      quota: {{requests_per_minit: 5}}\n"), "unknown field"),
    ];
    for (keys, want) in cases {
        let e = cfg(&keys).expect_err(&keys);
        assert!(e.contains(want), "{e:?} lacks {want:?}");
        assert!(e.starts_with("auth: auth.yaml"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
    }
    assert!(parse_config("f", "api:\n  mode: api-key\n")
        .expect_err("empty")
        .message()
        .contains("at least one key"));
    assert!(parse_config("f", "api:\n  mode: oauth\n")
        .expect_err("mode")
        .message()
        .contains("supported: none, api-key, dynamic"));
    assert!(parse_config("f", "admin:\n  mode: x\n")
        .expect_err("admin")
        .message()
        .contains("supported: none, api-key"));
    assert_eq!(
        parse_config("f", "api:\n  mode: dynamic\n")
            .expect("dyn")
            .api,
        ApiMode::Dynamic
    );
    assert_eq!(
        parse_config("f", "admin:\n  mode: none\n")
            .expect("none")
            .admin,
        Some(AdminMode::None)
    );
}

#[test]
fn dates() {
    assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0));
    assert_eq!(
        parse_rfc3339("2000-02-29T00:00:00.5+01:00"),
        Some(951_778_800)
    );
    assert_eq!(parse_rfc3339("2026-11-29T19:00:01Z"), Some(1_795_978_801));
    assert_eq!(parse_rfc3339("2026-13-01T00:00:00Z"), None);
    assert_eq!(parse_rfc3339("2026-11-29 19:00:01"), None);
    assert_eq!(parse_expiry_day("29-02-2000"), Some(951_868_800));
    assert_eq!(parse_expiry_day("29-02-2001"), None);
    assert_eq!(parse_expiry_day("1-1-2027x"), None);
}

#[test]
fn hashes_round_trip() {
    let h = parse_hash(H1).expect("hash");
    assert_eq!(hex(&h), H1);
    assert_eq!(parse_hash(&H1[1..]), None);
    assert_eq!(parse_hash(&format!("{}g", &H1[1..])), None);
}

proptest! {
    #[test]
    fn config_parser_never_panics(s in "\\PC{0,300}") {
        let _ = parse_config("f", &s);
    }

    #[test]
    fn dates_never_panic(s in "\\PC{0,40}") {
        let _ = parse_rfc3339(&s);
        let _ = parse_expiry_day(&s);
    }

    #[test]
    fn expiry_is_the_next_midnight(d in 1u32..=28, m in 1u32..=12, y in 1970i64..2200) {
        let e = parse_expiry_day(&format!("{d:02}-{m:02}-{y}")).expect("valid");
        let start = u64::try_from(days_from_civil(y, m, d)).expect("after 1970") * 86_400;
        prop_assert_eq!(e, start + 86_400);
    }
}

#[test]
fn one_bearer_parser_for_every_route() {
    let t = |a: Option<&str>, x: Option<&str>| {
        bearer_token(a.map(str::as_bytes), x.map(str::as_bytes))
            .map(|t| String::from_utf8_lossy(t).into_owned())
    };
    let some = |s: &str| Some(s.to_string());
    assert_eq!(t(Some("Bearer sk-1"), None), some("sk-1"));
    // Spaces around are trimmed; the prefix is exact-case (spec 05): in
    // another case it is part of the token, for admin keys too.
    assert_eq!(t(Some("  Bearer   sk-1  "), None), some("sk-1"));
    assert_eq!(t(Some("bearer sk-1"), None), some("bearer sk-1"));
    // A bare key is accepted as it is.
    assert_eq!(t(Some("sk-1"), None), some("sk-1"));
    assert_eq!(t(Some("Bearersk-1"), None), some("Bearersk-1"));
    // No token: x-api-key, else none.
    assert_eq!(t(Some("Bearer"), Some("sk-2")), some("sk-2"));
    assert_eq!(t(Some("Bearer   "), None), None);
    assert_eq!(t(None, Some(" sk-2 ")), some("sk-2"));
    assert_eq!(t(None, Some("  ")), None);
    assert_eq!(t(Some(""), None), None);
    // Authorization wins over x-api-key.
    assert_eq!(t(Some("Bearer a"), Some("b")), some("a"));
}
