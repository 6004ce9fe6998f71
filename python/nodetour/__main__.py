"""``python -m nodetour doctor [--json] [--no-live]``: the doctor's report (exit status as
the ``nodetour doctor`` command's)."""

import argparse
import sys

from . import doctor


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nodetour")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="this machine's GPUDirect RDMA readiness, why, and how to fix it")
    d.add_argument("--json", action="store_true", help="one JSON document (docs/doctor.md)")
    d.add_argument("--no-live", action="store_true", help="no live checks (facts only)")
    args = parser.parse_args(argv)
    text, status = doctor(json=args.json, live=not args.no_live)
    print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
