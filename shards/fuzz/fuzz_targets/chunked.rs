//! The chunked decoder against a reference decoder written from RFC 9112
//! 7.1: they agree on the payload and the bytes used, or ours refuses; the
//! result does not depend on how the input is split across reads.
#![no_main]
use libfuzzer_sys::fuzz_target;
use shards::logic::http::framing::http_parse::ChunkedDecoder;

/// Whole-input reference: Some((payload, used)) for a complete body.
fn reference(input: &[u8]) -> Option<(Vec<u8>, usize)> {
    let mut pos = 0;
    let mut out = Vec::new();
    loop {
        let rest = input.get(pos..)?;
        let nl = rest.windows(2).position(|w| w == b"\r\n")?;
        let line = &rest[..nl];
        let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
        if digits == 0 || digits > 15 {
            return None;
        }
        let ext = &line[digits..];
        let ok_ext = ext.is_empty()
            || (ext
                .iter()
                .all(|b| *b == b'\t' || (*b >= 0x20 && *b != 0x7f))
                && ext.iter().find(|b| **b != b' ' && **b != b'\t') == Some(&b';'));
        if !ok_ext {
            return None;
        }
        let n = u64::from_str_radix(std::str::from_utf8(&line[..digits]).ok()?, 16).ok()? as usize;
        pos += nl + 2;
        if n == 0 {
            loop {
                let rest = input.get(pos..)?;
                let nl = rest.windows(2).position(|w| w == b"\r\n")?;
                if rest[..nl].iter().any(|b| *b == b'\r' || *b == b'\n') {
                    return None;
                }
                pos += nl + 2;
                if nl == 0 {
                    return Some((out, pos));
                }
            }
        }
        let data = input.get(pos..pos.checked_add(n)?)?;
        out.extend_from_slice(data);
        pos += n;
        if input.get(pos..pos + 2)? != b"\r\n" {
            return None;
        }
        pos += 2;
    }
}

fn ours(input: &[u8], split: usize) -> Result<Option<(Vec<u8>, usize)>, ()> {
    let mut d = ChunkedDecoder::new();
    let mut out = Vec::new();
    let mut buf = Vec::new();
    let mut used_total = 0;
    for part in [&input[..split], &input[split..]] {
        buf.extend_from_slice(part);
        let used = d.decode(&buf, &mut out, 0).map_err(|_| ())?;
        buf.drain(..used);
        used_total += used;
        if d.is_done() {
            return Ok(Some((out, used_total)));
        }
    }
    Ok(None)
}

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    let split = data[0] as usize % data.len();
    let input = &data[1..];
    let split = split.min(input.len());
    let whole = ours(input, input.len());
    let parts = ours(input, split);
    assert_eq!(whole, parts, "the split changed the result");
    match (whole, reference(input)) {
        (Ok(Some(a)), Some(b)) => assert_eq!(a, b),
        (Ok(Some(a)), None) => panic!("we accepted what the reference refuses: {a:?}"),
        // Refused, or still incomplete: allowed either way (ours refuses
        // bare line ends before the reference sees a complete line).
        _ => {}
    }
});
