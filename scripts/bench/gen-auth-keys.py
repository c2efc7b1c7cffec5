"""Write an auth.yaml of N keys (default 10,000) for benchmarks: N-1 random
hashes over 500 tenants, and the key `sk-bench-key` with quotas too large
to refuse anything (so every request takes the whole quota path).

usage: python3 scripts/bench/gen-auth-keys.py OUT.yaml [N]"""
import hashlib
import os
import sys

out, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
with open(out, "w") as f:
    f.write("api:\n  mode: api-key\n  keys:\n")
    for i in range(n - 1):
        h = hashlib.sha256(os.urandom(32)).hexdigest()
        f.write(f'    - key_hash: "{h}"\n      metadata: {{name: k{i}, owner: tenant-{i % 500}}}\n'
                f'      quota: {{requests_per_minute: 1000, tokens_per_day: 1000000}}\n')
    h = hashlib.sha256(b"sk-bench-key").hexdigest()
    f.write(f'    - key_hash: "{h}"\n      metadata: {{name: bench, owner: bench}}\n'
            f'      quota: {{requests_per_minute: 1000000000, tokens_per_day: 1000000000000}}\n')
