"""The `flatwire` command: `flatwire up | scheduler | detokenizer | gateway | health`."""

import importlib
import os
import sys
import threading
from importlib.metadata import version

from services.common.model_store import ModelNotFound

COMMANDS = {
    "up": ("services.launcher", "run all three services on loopback until Ctrl-C"),
    "scheduler": ("services.scheduler.server", "run the scheduler (model, batching, sampling)"),
    "detokenizer": ("services.detokenizer.server", "run the detokenizer (text deltas, stop strings)"),
    "gateway": ("services.gateway.server", "run the gateway (HTTP + public gRPC)"),
    "health": ("services.common.healthcheck", "exit 0 when a gRPC service or HTTP URL is healthy"),
}


# The check reads every service's config: a tenth of a second that a restarting service should not wait for.
UNKNOWN_VARIABLES_AFTER_S = 10.0


def _warn_unknown_variables(prog: str) -> None:
    from services.launcher import unknown_variables  # every service's config: see UNKNOWN_VARIABLES_AFTER_S

    for name in unknown_variables(os.environ):
        print(f"{prog}: warning: {name} is no option of any flatwire service (misspelt?); ignored", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--version":
        print(f"flatwire {version('flatwire')}")
        return
    if not argv or argv[0] not in COMMANDS:
        lines = [f"  {name:<12} {summary}" for name, (_, summary) in COMMANDS.items()]
        usage = "usage: flatwire COMMAND [--help] | --version\n\ncommands:\n" + "\n".join(lines)
        if argv and argv[0] in ("-h", "--help"):  # asked for: on stdout, as argparse prints a command's help
            print(usage)
            return
        unknown = f"\n\nflatwire: unknown command {argv[0]!r}" if argv else ""
        print(usage + unknown, file=sys.stderr)
        sys.exit(2)
    module, _ = COMMANDS[argv[0]]
    prog = f"flatwire {argv[0]}"
    if argv[0] == "up":  # it reads every service's config anyway
        _warn_unknown_variables(prog)
    elif argv[0] != "health":  # a service: once it is up (a probe's output stays what it checked)
        later = threading.Timer(UNKNOWN_VARIABLES_AFTER_S, _warn_unknown_variables, (prog,))
        later.daemon = True
        later.start()
    try:
        importlib.import_module(module).main(argv[1:], prog=prog)
    except ModelNotFound as exc:  # a setup error, said in one line
        sys.exit(f"{prog}: {exc}")
    except KeyboardInterrupt:  # Ctrl-C before a service took over its signals (building the default model, say)
        sys.exit(130)


if __name__ == "__main__":
    main()
