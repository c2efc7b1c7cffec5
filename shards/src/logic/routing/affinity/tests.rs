use super::*;
use proptest::prelude::*;

fn marks_of(messages: &[(&str, &str)], system: &str) -> PrefixMarks {
    let mut h = PrefixHasher::default();
    for (role, text) in messages {
        h.token(role.as_bytes());
        h.text(text.as_bytes());
        h.message_end();
    }
    let sys = xxhash_rust::xxh64::xxh64(system.as_bytes(), 0);
    h.finish(seed_of(sys, 0), system.len() as u32, !system.is_empty())
}

fn cfg() -> AffinityCfg {
    AffinityCfg::default()
}

#[test]
fn a_next_turn_shares_the_previous_turns_marks() {
    let t1 = marks_of(&[("system", "be brief"), ("user", "hello")], "");
    let t2 = marks_of(
        &[
            ("system", "be brief"),
            ("user", "hello"),
            ("assistant", "hi!"),
            ("user", "and then?"),
        ],
        "",
    );
    let longest_t1 = t1.longest_first(2048).next().expect("a mark");
    assert!(t2.longest_first(2048).any(|m| m == longest_t1));
    // Another system prompt shares nothing.
    let other = marks_of(&[("system", "be long"), ("user", "hello")], "");
    assert!(!other.longest_first(2048).any(|m| m == longest_t1));
}

#[test]
fn long_messages_get_block_marks_and_the_step_block_filters_them() {
    let doc = "x".repeat(10 * 1024);
    let m = marks_of(&[("user", &doc)], "");
    let base: Vec<_> = m.longest_first(BASE_BLOCK).collect();
    let coarse: Vec<_> = m.longest_first(4096).collect();
    // 20 block marks + the message end at 512; at 4096: 8192, 4096, end.
    assert_eq!(base.len(), 21);
    assert_eq!(coarse.len(), 3);
    assert!(coarse.iter().all(|k| k.message_end || k.offset % 4096 == 0));
    // Longest first.
    assert!(base.windows(2).all(|w| w[0].offset >= w[1].offset));
}

#[test]
fn the_first_mark_survives_a_long_prompt() {
    let turns: Vec<(&str, String)> = (0..200).map(|i| ("user", format!("turn {i}"))).collect();
    let msgs: Vec<(&str, &str)> = turns.iter().map(|(r, t)| (*r, t.as_str())).collect();
    let m = marks_of(&msgs, "shared app prompt");
    assert_eq!(m.len(), MAX_MARKS);
    let all: Vec<_> = m.longest_first(0).collect();
    // The system prompt's own mark is the shortest and kept.
    assert_eq!(all.last().map(|k| k.offset), Some(17));
    let again = marks_of(&[("user", "other")], "shared app prompt");
    assert_eq!(again.longest_first(0).last(), all.last().copied());
}

#[test]
fn key_first_then_the_longest_prefix_with_a_live_holder() {
    let mut ix = AffinityIndex::new(1024);
    for a in [1, 2, 3] {
        ix.join(a);
    }
    let t1 = marks_of(&[("user", "hello")], "sys");
    let t2 = marks_of(
        &[("user", "hello"), ("assistant", "hi"), ("user", "more")],
        "sys",
    );
    let req = |key, marks| RequestKeys {
        salt: model_salt("m"),
        key,
        marks,
    };
    ix.record_request(&req(None, &t1), 2048, 2, 100);
    let h = ix.lookup(&req(None, &t2), &cfg(), 110);
    assert_eq!(h.kind, HitKind::Prefix);
    assert_eq!(h.iter().map(|x| x.agent).collect::<Vec<_>>(), vec![2]);
    assert_eq!(h.iter().next().map(|x| x.age), Some(10));
    // A key outranks the prefix.
    let key = raw_key_hash(b"session-9");
    let x = marks_of(&[("user", "x")], "");
    ix.record_request(&req(Some(key), &x), 2048, 3, 105);
    let h = ix.lookup(&req(Some(key), &t2), &cfg(), 110);
    assert_eq!(
        (h.kind, h.iter().next().map(|x| x.agent)),
        (HitKind::Key, Some(3))
    );
    // An unknown key falls back to the prefix.
    let h = ix.lookup(&req(Some(raw_key_hash(b"new")), &t2), &cfg(), 110);
    assert_eq!(h.kind, HitKind::Prefix);
}

#[test]
fn entries_expire_and_departed_agents_are_never_named() {
    let mut ix = AffinityIndex::new(64);
    ix.join(7);
    ix.join(8);
    let m = marks_of(&[("user", "q")], "");
    let r = RequestKeys {
        salt: 9,
        key: None,
        marks: &m,
    };
    ix.record_request(&r, 2048, 7, 10);
    ix.record_request(&r, 2048, 8, 20);
    let c = AffinityCfg {
        ttl_seconds: 30,
        ..cfg()
    };
    let names = |ix: &AffinityIndex, now| {
        ix.lookup(&r, &c, now)
            .iter()
            .map(|h| h.agent)
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&ix, 25), vec![8, 7], "most recent first");
    assert_eq!(names(&ix, 45), vec![8], "7's entry expired (35 s > 30 s)");
    ix.leave(8);
    assert!(names(&ix, 25).iter().all(|a| *a != 8), "8 left");
    ix.join(8);
    // A returning agent is the same id only if the shard reuses it (it
    // does not); its old entries are not a reason to avoid it either.
    assert_eq!(names(&ix, 25), vec![8, 7]);
}

#[test]
fn the_table_is_allocated_once_at_its_bound() {
    let ix = AffinityIndex::new(1_000_000);
    assert_eq!(ix.capacity(), 1 << 20);
    assert_eq!(ENTRY_BYTES, 40);
    assert_eq!(ix.table_bytes(), (1 << 20) * 40);
}

#[derive(Debug, Clone)]
enum Op {
    Join(u64),
    Leave(u64),
    Record(u64, u64, u32),
    Lookup(u64, u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u64..12).prop_map(Op::Join),
        (0u64..12).prop_map(Op::Leave),
        (0u64..400, 0u64..12, 0u32..50).prop_map(|(h, a, t)| Op::Record(h, a, t)),
        (0u64..400, 0u32..50).prop_map(|(h, t)| Op::Lookup(h, t)),
    ]
}

proptest! {
    /// Whatever happens, the table stays at its size, an entry names at
    /// most HOLDERS agents, and a departed agent is never named.
    #[test]
    fn the_index_never_grows_nor_names_a_departed_agent(ops in proptest::collection::vec(op(), 1..400)) {
        let mut ix = AffinityIndex::new(64);
        let bytes = ix.table_bytes();
        let mut live = std::collections::HashSet::new();
        let mut now = 1u32;
        for o in ops {
            match o {
                Op::Join(a) => { ix.join(a); live.insert(a); }
                Op::Leave(a) => { ix.leave(a); live.remove(&a); }
                Op::Record(h, a, dt) => { now += dt; ix.record(h.wrapping_mul(0x9E37_79B9_7F4A_7C15), a, now); }
                Op::Lookup(h, dt) => {
                    now += dt;
                    let hs = ix.holders(h.wrapping_mul(0x9E37_79B9_7F4A_7C15), 0, now, 600);
                    prop_assert!(hs.iter().count() <= HOLDERS);
                    for x in hs.iter() {
                        prop_assert!(live.contains(&u64::from(x.agent)), "named departed {}", x.agent);
                        prop_assert!(x.age <= 600);
                    }
                }
            }
            prop_assert_eq!(ix.table_bytes(), bytes);
            prop_assert!(ix.used() <= ix.capacity());
        }
    }
}

/// A system prompt longer than a block: its first block mark is not a
/// message end, and must not hide the conversation's entries (the first
/// mark the early exit checks is the system prompt's end).
#[test]
fn a_long_system_prompt_still_hits() {
    let system = "Be careful. ".repeat(100);
    let t1 = marks_of(&[("system", &system), ("user", "q1")], "");
    let t2 = marks_of(
        &[
            ("system", &system),
            ("user", "q1"),
            ("assistant", "a"),
            ("user", "q2"),
        ],
        "",
    );
    let mut ix = AffinityIndex::new(1024);
    ix.join(5);
    let req = |m| RequestKeys {
        salt: 1,
        key: None,
        marks: m,
    };
    ix.record_request(&req(&t1), 2048, 5, 10);
    let h = ix.lookup(&req(&t2), &cfg(), 11);
    assert_eq!(h.iter().map(|x| x.agent).collect::<Vec<_>>(), vec![5]);
    assert!(
        h.iter().all(|x| x.depth > 1200),
        "the deepest shared mark: {h:?}"
    );
}

/// A note published by one router, recorded by another (its own agent
/// numbering), makes the next turn of the conversation hit there.
#[test]
fn a_shared_note_lets_another_router_find_the_conversation() {
    let t1 = marks_of(&[("user", "hello")], "sys");
    let t2 = marks_of(
        &[("user", "hello"), ("assistant", "hi"), ("user", "more")],
        "sys",
    );
    let key = raw_key_hash(b"session-1");
    let req = |key, marks| RequestKeys {
        salt: model_salt("m"),
        key,
        marks,
    };
    let note = AffinityNote::of(&req(Some(key), &t1), 2048, peer_hash("12D3KooWpeer"));
    assert!(note.len >= 2 && usize::from(note.len) <= NOTE_HASHES);
    let mut blob = Vec::new();
    note.encode(&mut blob);
    AffinityNote::default().encode(&mut blob);
    assert_eq!(
        AffinityNote::decode_all(&blob),
        vec![note, AffinityNote::default()]
    );
    // On the other router the agent is number 7.
    let mut ix = AffinityIndex::new(1024);
    ix.join(7);
    for n in AffinityNote::decode_all(&blob).iter().take(1) {
        for h in n.hashes() {
            ix.record(*h, 7, 100);
        }
    }
    let h = ix.lookup(&req(None, &t2), &cfg(), 101);
    assert_eq!(h.kind, HitKind::Prefix);
    assert_eq!(h.iter().map(|x| x.agent).collect::<Vec<_>>(), vec![7]);
    let h = ix.lookup(&req(Some(key), &t2), &cfg(), 101);
    assert_eq!(h.kind, HitKind::Key);
}

#[test]
fn a_long_prompt_publishes_its_first_and_newest_marks_only() {
    let msgs: Vec<(&str, String)> = (0..60).map(|i| ("user", format!("m{i}"))).collect();
    let refs: Vec<(&str, &str)> = msgs.iter().map(|(r, t)| (*r, t.as_str())).collect();
    let marks = marks_of(&refs, "");
    let req = RequestKeys {
        salt: model_salt("m"),
        key: None,
        marks: &marks,
    };
    let note = AffinityNote::of(&req, 2048, 1);
    assert_eq!(usize::from(note.len), NOTE_HASHES);
    let first = marks.longest_first(2048).next().expect("a mark");
    assert!(note.hashes().contains(&salted(req.salt, first.hash)));
}

proptest! {
    /// Whatever a store hands back, decoding never panics and never
    /// yields a note with more hashes than a note holds.
    #[test]
    fn any_blob_decodes_to_valid_notes(blob in proptest::collection::vec(any::<u8>(), 0..600)) {
        for n in AffinityNote::decode_all(&blob) {
            prop_assert!(usize::from(n.len) <= NOTE_HASHES);
        }
    }
}

/// Issue 51 #1: what the index takes is known before it is made, and a
/// count past what can be addressed is `None`, never a panic.
#[test]
fn table_bytes_is_what_new_allocates_and_never_overflows() {
    for (entries, shards) in [
        (1024usize, 1usize),
        (1 << 20, 1),
        (1 << 20, 2),
        (3_000_000, 3),
    ] {
        let per = AffinityIndex::new(entries / shards).table_bytes() as u64;
        assert_eq!(table_bytes(entries, shards), Some(per * shards as u64));
    }
    assert_eq!(table_bytes(usize::MAX, 1), None);
    assert_eq!(table_bytes(usize::MAX, 2), None);
    assert!(table_bytes(1 << 40, 1).is_some_and(|b| b >= (1u64 << 40) * ENTRY_BYTES as u64));
}

#[test]
fn a_holder_predicts_its_prefix_in_tokens_never_more_than_the_prompt() {
    let h = |depth| Holder {
        agent: 1,
        depth,
        age: 0,
        hash: 0,
    };
    // 4 bytes a token: 4,000 bytes of prefix are 1,000 tokens.
    assert_eq!(predicted_tokens(&h(4_000), 0.25, 3_000), 1_000);
    assert_eq!(
        predicted_tokens(&h(40_000), 0.25, 3_000),
        3_000,
        "capped by the prompt"
    );
    // A session key's holder: the previous turn, half the prompt.
    assert_eq!(predicted_tokens(&h(0), 0.25, 3_000), 1_500);
}

#[test]
fn entries_name_the_live_holders_only() {
    let mut ix = AffinityIndex::new(64);
    ix.join(1);
    ix.join(2);
    ix.record(11 << 20, 1, 5);
    ix.record(22 << 20, 2, 5);
    ix.leave(2);
    assert_eq!(ix.entries(), vec![(11 << 20, 1)]);
}

/// Holders come most recent first, and within one second in the order
/// they were recorded (the latest first): the choice takes the freshest.
#[test]
fn holders_of_the_same_second_come_latest_first() {
    let mut ix = AffinityIndex::new(64);
    for a in 1..=5 {
        ix.join(a);
    }
    let order = |ix: &AffinityIndex| -> Vec<u32> {
        ix.holders(7 << 20, 0, 10, 600)
            .iter()
            .map(|h| h.agent)
            .collect()
    };
    ix.record(7 << 20, 1, 10);
    ix.record(7 << 20, 2, 10);
    ix.record(7 << 20, 3, 10);
    assert_eq!(order(&ix), vec![3, 2, 1]);
    // Agent 1 again: first; a fifth holder replaces the oldest (2).
    ix.record(7 << 20, 1, 10);
    ix.record(7 << 20, 4, 10);
    ix.record(7 << 20, 5, 10);
    assert_eq!(order(&ix), vec![5, 4, 1, 3]);
    // An older second comes after, whatever the table's order (2 took
    // the place of the last of the oldest, 3).
    ix.record(7 << 20, 2, 9);
    assert_eq!(order(&ix), vec![5, 4, 1, 2]);
}
