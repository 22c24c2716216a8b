"""Run `rollout bench --scenario gateway`'s plan against an earlier rollout.

The gateway scenario is newer than the code it measured before: this runs today's bench
(`bench/_gateway.py`) with whatever `rollout.engine` and `rollout.protocol` Python finds first,
so an earlier checkout can be put in front of the installed one (bench/README.md, "The gateway
floor", gives the commands). Writes results.json and summary.md to the folder given.

    python bench/scripts/gateway_before.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import trio
from rollout.bench import _gateway as gateway
from rollout.engine import _engine


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    results = trio.run(gateway.run_gateway, gateway.GatewayPlan(), out, print)
    results["meta"]["engine"] = _engine.__file__
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    summary = gateway.render_gateway_summary(results)
    (out / "summary.md").write_text(summary)
    print(summary)


if __name__ == "__main__":
    main()
