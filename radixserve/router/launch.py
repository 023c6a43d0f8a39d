"""`radixserve route`: the router's command-line options and its uvicorn process."""

from __future__ import annotations

import argparse
import logging
import signal

from radixserve.router.policy import POLICIES, CacheAwareConfig
from radixserve.router.config import RouterConfig


def add_route_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL",
        help="a radixserve server (repeat for each; more can be added at run time with POST /workers)",
    )
    p.add_argument(
        "--policy",
        default="cache_aware",
        choices=POLICIES,
        help="where a request goes: the worker holding its prefix (cache_aware), in turn (round_robin), "
        "or the least busy (least_load) (default: %(default)s)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=30000, help="port to listen on (default: %(default)s)")
    d, r = CacheAwareConfig(), RouterConfig()
    p.add_argument(
        "--cache-threshold",
        type=float,
        default=d.cache_threshold,
        help="cache_aware: route to the worker with the longest match when it covers more than this "
        "fraction of the prompt text",
    )
    p.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=d.balance_abs_threshold,
        help="cache_aware: a worker is overloaded when its in-flight requests exceed the least loaded "
        "worker's by more than this ...",
    )
    p.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=d.balance_rel_threshold,
        help="... and are more than this many times the least loaded worker's",
    )
    p.add_argument(
        "--max-tree-chars",
        type=int,
        default=d.max_tree_chars,
        help="cache_aware: characters of prompt text remembered per worker",
    )
    p.add_argument("--eviction-interval", type=float, default=d.eviction_interval_s, help="seconds between evictions")
    p.add_argument("--health-interval", type=float, default=r.health_interval_s, help="seconds between health checks")
    p.add_argument("--max-attempts", type=int, default=r.max_attempts, help="workers tried per request")
    p.add_argument("--admin-key", default=None, help="require `Authorization: Bearer KEY` to add or remove workers")


def run_router(args: argparse.Namespace) -> None:
    import uvicorn

    from radixserve.router.app import build_router_app

    class Server(uvicorn.Server):
        """SIGTERM: finish the streams in flight (up to the grace period), then exit 0. Stock uvicorn re-raises the
        signal once shut down, so the process would die by it and a supervisor would see a failure."""

        def handle_exit(self, sig: int, frame: object) -> None:
            if sig != signal.SIGTERM:
                return super().handle_exit(sig, frame)  # type: ignore[arg-type]
            self.force_exit = self.should_exit  # a second SIGTERM: stop waiting
            self.should_exit = True

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cache = CacheAwareConfig(
        args.cache_threshold,
        args.balance_abs_threshold,
        args.balance_rel_threshold,
        args.max_tree_chars,
        args.eviction_interval,
    )
    if args.max_attempts < 1:
        raise ValueError(f"--max-attempts must be >= 1, got {args.max_attempts}")
    config = RouterConfig(max_attempts=args.max_attempts, health_interval_s=args.health_interval)
    app = build_router_app(args.worker, args.policy, cache, config, admin_key=args.admin_key)
    try:
        # Many idle keep-alive connections are normal for a front: keep them a while.
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            lifespan="off",
            timeout_keep_alive=30,
            timeout_graceful_shutdown=30,
        )
        Server(config).run()
    finally:
        app.state.close()
