"""The Python entry of the Ray Serve deployment, for clusters driven from Python rather than from
``serve_config.yaml``:

    python deploy/ray/vitembed_app.py --address auto --model embedded --replicas 2 --num-gpus 1

connects to a running cluster, deploys the app (Serve's HTTP proxy on ``--host``/``--port``) and returns;
``serve shutdown`` removes it. The deployment itself lives in ``vitembed.ray_serve`` (so every node imports
the same code); ``serve_config.yaml`` next to this file is the declarative equivalent, with autoscaling.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from vitembed.ray_serve import MAX_ONGOING_REQUESTS, MAX_QUEUED_REQUESTS, deployment
from vitembed.settings import parse_model_args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    parser.add_argument("--model", action="append", default=[], help="NAME=PATH_OR_ID (repeatable)")
    parser.add_argument("--settings", default="{}", help="more ServiceSettings fields, as JSON")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per replica")
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica")
    parser.add_argument("--max-ongoing-requests", type=int, default=MAX_ONGOING_REQUESTS)
    parser.add_argument("--max-queued-requests", type=int, default=MAX_QUEUED_REQUESTS)
    parser.add_argument("--host", default="127.0.0.1", help="Serve's HTTP proxy address")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    settings: dict[str, Any] = json.loads(args.settings)
    if args.model:
        settings["models"] = parse_model_args(args.model)
    if args.num_gpus > 0:
        settings.setdefault("device", "cuda")
    ray.init(address=args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = deployment().options(
        num_replicas=args.replicas,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        ray_actor_options={"num_cpus": args.num_cpus, "num_gpus": args.num_gpus},
    )
    serve.run(app.bind(settings), name="vitembed", route_prefix="/")
    print(f"vitembed is served by {args.replicas} replicas at http://{args.host}:{args.port}")


if __name__ == "__main__":
    main()
