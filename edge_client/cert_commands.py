"""`offload certs init|issue`: a small CA and certificates for users without a PKI.

- `offload certs init --dir DIR [--name NAME] [--days N]` writes `DIR/ca.pem` (give it to
  every broker, node and client as `--tls-ca`) and `DIR/ca-key.pem` (0600; keep it on the
  host that issues certificates only).
- `offload certs issue NAME --role broker|node|client --ca-dir DIR [--out-dir DIR]
  [--dns NAME ...] [--ip ADDRESS ...] [--days N]` writes `NAME.pem` and `NAME-key.pem`
  (0600): a certificate for the broker, a node (NAME is its node id: the broker checks it)
  or a client, valid for the DNS names and addresses peers dial it by. The role is in the
  certificate (SAN URI `offload:role=ROLE`): nodes take NodeAgent calls only from a broker
  certificate, so a node's certificate does not open other nodes.

Nothing is ever overwritten; a key is never printed. Operators with a PKI of their own give
its PEM files to the same flags instead.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from common.certs import (
    CA_DAYS,
    CA_FILE,
    CA_KEY_FILE,
    LEAF_DAYS,
    ROLES,
    CertError,
    issue,
    load_identity,
    make_ca,
    write_new,
)
from runtime.errors import quote

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
"""A certificate's name is also its file name: no path separators, no leading dot."""


def _init(args: argparse.Namespace) -> int:
    directory: Path = args.dir
    cert, key = make_ca(args.name, args.days)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for path in (directory / CA_FILE, directory / CA_KEY_FILE):
        if path.exists():
            raise CertError(f"{path} exists: this folder has a CA already")
    write_new(directory / CA_KEY_FILE, key)
    write_new(directory / CA_FILE, cert, 0o644)
    print(f"CA {args.name!r}, valid {args.days} days:")
    print(f"  {directory / CA_FILE}: give it to every broker, node and client as --tls-ca")
    print(f"  {directory / CA_KEY_FILE}: mode 0600, keep it here (it signs certificates)")
    return 0


def _issue(args: argparse.Namespace) -> int:
    if not _NAME.fullmatch(args.name):
        raise CertError(
            f"name {quote(args.name)}: use letters, digits, '.', '_' and '-' (a node's id)"
        )
    ca_dir: Path = args.ca_dir
    ca = load_identity(
        ca_dir / CA_FILE,
        ca_dir / CA_KEY_FILE,
        ca_dir / CA_FILE,
        ("--ca-dir", "--ca-dir", "--ca-dir"),
    )
    out: Path = args.out_dir or ca_dir
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    cert, key = issue(ca.cert, ca.key, args.name, args.dns, args.ip, args.days, args.role)
    cert_path, key_path = out / f"{args.name}.pem", out / f"{args.name}-key.pem"
    for path in (cert_path, key_path):
        if path.exists():
            raise CertError(f"{path} exists: remove it first, or give another --out-dir")
    write_new(key_path, key)
    write_new(cert_path, cert, 0o644)
    names = ", ".join([*args.dns, *args.ip])
    print(f"{args.role} certificate for {args.name} ({names}), valid {args.days} days:")
    print(f"  --tls-cert {cert_path} --tls-key {key_path} --tls-ca {ca_dir / CA_FILE}")
    return 0


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.certs_func(args))
    except CertError as err:
        print(f"offload certs: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"offload certs: {err.filename}: {err.strerror}", file=sys.stderr)
        return 2


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "certs",
        help="make a small CA and TLS certificates (for users without a PKI)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="certs_command", metavar="ACTION", required=True)
    init = sub.add_parser("init", help="make a CA: ca.pem and ca-key.pem (0600)")
    init.add_argument("--dir", type=Path, required=True, help="folder for the CA's files")
    init.add_argument("--name", default="edge-offload CA", help="the CA's common name")
    init.add_argument("--days", type=int, default=CA_DAYS, help=f"validity (default {CA_DAYS})")
    init.set_defaults(func=_run, certs_func=_init)
    issue_p = sub.add_parser(
        "issue", help="issue a certificate and key (0600) for a broker, a node or a client"
    )
    issue_p.add_argument("name", help="its common name and file name; for a node: its node id")
    issue_p.add_argument(
        "--role",
        choices=ROLES,
        required=True,
        help="what it is for: nodes take NodeAgent calls from a broker certificate only",
    )
    issue_p.add_argument(
        "--ca-dir", type=Path, required=True, help="the folder of `offload certs init`"
    )
    issue_p.add_argument(
        "--out-dir", type=Path, help="where NAME.pem and NAME-key.pem go (default: --ca-dir)"
    )
    issue_p.add_argument(
        "--dns",
        action="append",
        default=[],
        metavar="NAME",
        help="a DNS name peers dial it by (repeat for more)",
    )
    issue_p.add_argument(
        "--ip",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="an IP address peers dial it by (repeat for more)",
    )
    issue_p.add_argument(
        "--days", type=int, default=LEAF_DAYS, help=f"validity (default {LEAF_DAYS})"
    )
    issue_p.set_defaults(func=_run, certs_func=_issue)
