#!/usr/bin/env python3
"""The WAN between the sites of the test fleet (tests/common/fleet.rs).

This machine's kernel has no netem (`tc qdisc add ... netem` answers
"Specified qdisc kind is unknown"), so the delay between sites is made
here: the fleet's WAN namespace routes every packet from one site to
another into a TUN device; this program reads each one, holds it for the
one-way delay between its source and destination sites, and writes it
back, and the kernel forwards it on to its destination. Packets of one
pair of sites keep their order (one FIFO per pair, one fixed delay).

Usage: wan-delay.py DEV SPEC
  DEV   the TUN device to create (it must not exist)
  SPEC  one-way delays in ms, "a-b=ms,..." by the sites' numbers (the
        third octet of 10.X.site.host); unlisted pairs get 0; a pair
        listed once applies both ways; "loss=P" drops that fraction.
Prints "ready" once the device exists.
"""

import fcntl
import heapq
import os
import random
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def parse(spec):
    delays, loss = {}, 0.0
    for part in filter(None, spec.split(",")):
        key, _, val = part.partition("=")
        if key == "loss":
            loss = float(val)
            continue
        a, _, b = key.partition("-")
        ms = float(val) / 1000.0
        delays[(int(a), int(b))] = ms
        delays.setdefault((int(b), int(a)), ms)
    return delays, loss


def main():
    dev, spec = sys.argv[1], sys.argv[2]
    delays, loss = parse(spec)
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    print("ready", flush=True)
    due = []  # (when, seq, packet)
    seq = 0
    while True:
        timeout = None
        if due:
            timeout = max(0.0, due[0][0] - time.monotonic())
        readable, _, _ = select.select([fd], [], [], timeout)
        now = time.monotonic()
        if readable:
            while True:
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if len(pkt) < 20 or pkt[0] >> 4 != 4:
                    continue
                if loss and random.random() < loss:
                    continue
                d = delays.get((pkt[14], pkt[18]), 0.0)
                seq += 1
                heapq.heappush(due, (now + d, seq, pkt))
        while due and due[0][0] <= time.monotonic():
            _, _, pkt = heapq.heappop(due)
            try:
                os.write(fd, pkt)
            except OSError:
                pass


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
