"""`python -m engine.parallel.rank RANK`: one rank of a tensor-parallel worker; its
RankSpec (engine/parallel/ranks.py) comes pickled on stdin from rank 0."""

from __future__ import annotations

import logging
import pickle
import sys


def main() -> int:
    rank = int(sys.argv[1])
    spec = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    from engine.parallel.ranks import run_rank

    return run_rank(spec, rank)


if __name__ == "__main__":
    sys.exit(main())
