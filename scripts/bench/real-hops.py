"""Where a proxy's time goes, from a loopback packet capture (issue 34).

The client-side figures of real-compare.sh are totals, and the engine's own
spread (a few ms between rounds) hides a proxy's fraction of a ms. Packets
do not: the kernel stamps each one as it is sent, so for every request the
capture gives, on the same clock,
  t_in      the client's request reaching the proxy's port
  t_engine  the request leaving for the engine (llama-server's port)
  e_k       the engine's k-th SSE content event leaving the engine
  c_k       the same event leaving the proxy for the client
and for hivenet also the hop in between (router -> agent over the libp2p
link and back: encrypted, so taken as the first link packet after the
event). The proxy's added time to the first content token is
(t_engine - t_in) + (c_1 - e_1): exact, whatever the engine's speed.
Requests are sequential (hivenet-bench --interleave), so the packets of one
request are the ones between its start and the next request's.

Usage: python3 real-hops.py PCAP ENGINE_PORT NAME:CLIENT_PORT[:LINK_PORT]...
Prints a Markdown summary (medians, p90, per hop)."""
import statistics
import struct
import sys

CONTENT = b'"content":"'  # a content delta; llama.cpp's role event has "content":null
TEXT = b'"text":"'


def packets(path):
    """(time s, sport, dport, payload) of every TCP packet with a payload,
    and a SYN (connect) as an empty payload with sport 0 on its dport."""
    with open(path, "rb") as f:
        data = f.read()
    magic = struct.unpack_from("<I", data, 0)[0]
    if magic == 0xA1B2C3D4:
        scale = 1e-6
    elif magic == 0xA1B23C4D:
        scale = 1e-9
    else:
        sys.exit(f"{path}: not a little-endian pcap file")
    linktype = struct.unpack_from("<I", data, 20)[0]
    link_len = {1: 14, 113: 16, 276: 20, 0: 4}.get(linktype)
    if link_len is None:
        sys.exit(f"{path}: link type {linktype} not handled")
    off = 24
    out = []
    while off + 16 <= len(data):
        sec, frac, incl, _ = struct.unpack_from("<IIII", data, off)
        off += 16
        pkt = data[off:off + incl]
        off += incl
        ip = pkt[link_len:]
        if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 6:
            continue
        ihl = (ip[0] & 15) * 4
        total = struct.unpack_from(">H", ip, 2)[0]
        tcp = ip[ihl:total]
        if len(tcp) < 20:
            continue
        sport, dport = struct.unpack_from(">HH", tcp, 0)
        doff = (tcp[12] >> 4) * 4
        payload = tcp[doff:]
        flags = tcp[13]
        if payload:
            out.append((sec + frac * scale, sport, dport, payload))
        elif flags & 0x02 and not flags & 0x10:  # SYN without ACK: a connect
            out.append((sec + frac * scale, 0, dport, b""))
    return out


class Request:
    def __init__(self, name, t_in, stream):
        self.name, self.t_in, self.stream = name, t_in, stream
        self.t_engine = None  # request out to the engine
        self.t_link_out = None  # hivenet: router -> agent
        self.engine_events = []  # engine -> proxy: content packets
        self.engine_last = None
        self.client_events = []  # proxy -> client: content packets
        self.client_last = None
        self.link_back = []  # hivenet: agent -> router packets
        self.connects = 0  # connects to the engine on the request's path


def split(pkts, engine, targets):
    """Requests in time order, with their packets' times."""
    by_client = {cp: name for name, cp, _ in targets}
    links = {name: lp for name, _, lp in targets if lp}
    reqs, cur = [], None
    for t, sp, dp, pl in pkts:
        if sp == 0:
            if cur is not None and dp == engine and cur.t_engine is None:
                cur.connects += 1
            continue
        if dp in by_client and pl.startswith(b"POST "):
            name = by_client[dp]
            # A POST to the engine's port is the forwarded one of the
            # request under way, until that one has reached the engine.
            if not (dp == engine and cur is not None and cur.name != "direct" and cur.t_engine is None):
                cur = Request(name, t, b'"stream":true' in pl)
                if name == "direct":
                    cur.t_engine = t
                reqs.append(cur)
                continue
        if cur is None:
            continue
        cp = next(c for n, c, _ in targets if n == cur.name)
        lp = links.get(cur.name)
        if dp == engine and pl.startswith(b"POST ") and cur.t_engine is None:
            cur.t_engine = t
        elif lp and sp == lp and cur.t_link_out is None and len(pl) > 100:
            cur.t_link_out = t
        elif lp and dp == lp:
            cur.link_back.append(t)
        if sp == engine and cur.t_engine is not None:
            if CONTENT in pl or TEXT in pl:
                cur.engine_events.append(t)
            cur.engine_last = t
        if sp == cp and cur.name != "direct":
            if CONTENT in pl or TEXT in pl:
                cur.client_events.append(t)
            cur.client_last = t
    return reqs


def ms(x):
    return x * 1e3


def stats(xs):
    if not xs:
        return "n/a"
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
    return f"{statistics.median(xs):.3f} / {p90:.3f}"


def main():
    pcap, engine = sys.argv[1], int(sys.argv[2])
    targets = []
    for spec in sys.argv[3:]:
        parts = spec.split(":")
        targets.append((parts[0], int(parts[1]), int(parts[2]) if len(parts) > 2 else None))
    reqs = split(packets(pcap), engine, targets)
    print("# Per hop, from the packets (kernel send stamps on loopback)\n")
    print("Each cell: median / p90 over requests, ms. `in` is the client's request to the")
    print("request leaving for the engine; `out` is an event leaving the engine to the same")
    print("event leaving for the client. Added to the first token = in + out (first content event).\n")
    print("| target | kind | requests | in | connects on the path | out, first content | added to first content | out, every content event | whole: in + last byte out |")
    print("|---|---|---|---|---|---|---|---|---|")
    hop_rows = []
    for name, _, lp in targets:
        if name == "direct":
            continue
        mine = [r for r in reqs if r.name == name and r.t_engine is not None]
        streams = [r for r in mine if r.stream and r.engine_events and r.client_events]
        wholes = [r for r in mine if not r.stream and r.engine_last and r.client_last]
        for kind, rs in (("stream", streams), ("whole", wholes)):
            ins = [ms(r.t_engine - r.t_in) for r in rs]
            conn = sum(1 for r in rs if r.connects)
            if kind == "stream":
                first = stats([ms(r.client_events[0] - r.engine_events[0]) for r in rs])
                added = stats([ms(r.t_engine - r.t_in + r.client_events[0] - r.engine_events[0]) for r in rs])
                every = stats([ms(c - e) for r in rs for e, c in zip(r.engine_events, r.client_events)])
                whole = ""
            else:
                first = added = every = ""
                whole = stats([ms(r.t_engine - r.t_in + r.client_last - r.engine_last) for r in rs])
            print(f"| {name} | {kind} | {len(rs)} | {stats(ins)} | {conn} | {first} | {added} | {every} | {whole} |")
        if lp:
            for kind, rs in (("stream", streams), ("whole", wholes)):
                rin = [ms(r.t_link_out - r.t_in) for r in rs if r.t_link_out]
                ain = [ms(r.t_engine - r.t_link_out) for r in rs if r.t_link_out]
                aout, rout = [], []
                for r in rs:
                    if not r.stream:
                        continue
                    back = [t for t in r.link_back if r.engine_events[0] <= t <= r.client_events[0]]
                    if back:
                        aout.append(ms(back[0] - r.engine_events[0]))
                        rout.append(ms(r.client_events[0] - back[0]))
                hop_rows.append((f"{name} {kind}", rin, ain, aout, rout))
    if hop_rows:
        print("\nThe hops of router + agent (first content event), median / p90, ms:\n")
        print("| target | router in (client -> link) | agent in (link -> engine) | agent out (engine -> link) | router out (link -> client) |")
        print("|---|---|---|---|---|")
        for name, rin, ain, aout, rout in hop_rows:
            print(f"| {name} | {stats(rin)} | {stats(ain)} | {stats(aout)} | {stats(rout)} |")
    odd = [r for r in reqs if r.name != "direct" and r.stream and len(r.engine_events) != len(r.client_events)]
    print(f"\nStreams whose content-event packet counts differ between engine and client "
          f"(an event split or coalesced on the way): {len(odd)} of "
          f"{sum(1 for r in reqs if r.name != 'direct' and r.stream)}.")


if __name__ == "__main__":
    main()
