"""Read every file under a folder once, in parallel, and report the throughput.

The cache-warming Job of the chart (cacheWarming) runs this with the serving image's Python:
    python3 -c "$(cat warm-weights.py)" MODEL_FOLDER WORKERS
On a file system that loads lazily from object storage (FSx for Lustre linked to S3) the first
read of a file fetches it; after this Job the engines' loads read at the file system's own speed.
The summary line gives the rate this pod read at, to compare with the rate the cell needs
(docs/deploy.md, "Models and caches").
"""
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

BLOCK = 16 << 20
local = threading.local()


def read_all(path):
    buf = getattr(local, "buf", None)
    if buf is None:
        buf = local.buf = bytearray(BLOCK)
    view = memoryview(buf)
    total = 0
    with open(path, "rb", buffering=0) as handle:
        while True:
            n = handle.readinto(view)
            if not n:
                return total
            total += n


def main(root, workers):
    files = sorted(os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names)
    if not files:
        print(f"warm: no files under {root}", file=sys.stderr)
        return 1
    start = time.monotonic()
    done = 0
    with ThreadPoolExecutor(workers) as pool:
        for count, size in enumerate(pool.map(read_all, files), 1):
            done += size
            if count % 50 == 0:
                print(f"warm: {count}/{len(files)} files, {done / 1e9:.1f} GB", flush=True)
    seconds = max(time.monotonic() - start, 1e-6)
    print(f"warm: read {len(files)} files, {done / 1e9:.1f} GB in {seconds:.0f} s: "
          f"{done / 1e9 / seconds:.2f} GB/s with {workers} readers", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
