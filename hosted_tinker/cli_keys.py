"""``hosted-tinker keys``: create, list, limit and revoke the API keys in a server's data
directory (its SQLite store; the server need not be running)."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hosted_tinker.server.quotas import DERIVED, Limits, parse_limits

if TYPE_CHECKING:
    from hosted_tinker.server.persistence.store import Store


def add_keys_parser(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="create, list, limit and revoke API keys")
    keys_sub = keys.add_subparsers(dest="action", required=True)
    actions = (
        ("create", "print a new key"),
        ("list", "list keys"),
        ("show", "show a key's limits"),
        ("limit", "set a key's own limits (NAME=default: back to the server's)"),
        ("revoke", "revoke a key"),
    )
    for action, text in actions:
        p = keys_sub.add_parser(action, help=text)
        p.add_argument("--data-dir", default="./hosted-tinker-data")
        if action == "create":
            p.add_argument("--name", default="default", help="a label for the key")
        if action in ("show", "limit", "revoke"):
            p.add_argument("key", help="the key's id (key-...) or name")
        if action == "create":
            p.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE", help="a limit of its own")
        if action == "limit":
            p.add_argument("limit", nargs="+", metavar="NAME=VALUE", help=", ".join(Limits.model_fields))
    keys.set_defaults(func=run_keys)


def run_keys(args: argparse.Namespace) -> int:
    from hosted_tinker.server.keys import create_key
    from hosted_tinker.server.persistence.schema import DATABASE, DatabaseDamaged, check
    from hosted_tinker.server.persistence.store import Store

    try:
        check(Path(args.data_dir) / DATABASE)
    except DatabaseDamaged as e:
        raise SystemExit(str(e)) from None
    store = Store.in_data_dir(Path(args.data_dir))
    settings: list[str] = getattr(args, "limit", [])
    reset = {s.removesuffix("=default") for s in settings if s.endswith("=default") and args.action == "limit"}
    try:
        if unknown := reset - set(Limits.model_fields):
            raise ValueError(f"--limit {sorted(unknown)[0]}=default: not a limit ({', '.join(Limits.model_fields)})")
        own = parse_limits([s for s in settings if s.removesuffix("=default") not in reset], "--limit")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.action == "create":
        key_id, key = create_key(store, args.name)
        store.set_api_key_limits(key_id, own)
        print(key)
        print(f"created {key_id} ({args.name}); the key is shown only now", file=sys.stderr)
    elif args.action == "limit":
        key_id = _key_id(store, args.key)
        kept = {k: v for k, v in store.api_key_limits(key_id).items() if k not in reset}
        store.set_api_key_limits(key_id, {**kept, **own})
        _show_limits(store, key_id)
    elif args.action == "show":
        _show_limits(store, _key_id(store, args.key))
    elif args.action == "list":
        for k in store.list_api_keys():
            created = dt.datetime.fromtimestamp(k.created_at).isoformat(timespec="seconds")
            state = "revoked" if k.revoked_at is not None else "active"
            print(f"{k.key_id}  {k.prefix}...  {state:7}  {created}  {k.name}")
    else:
        if store.revoke_api_key(args.key) == 0:
            raise SystemExit(f"no active key with id or name {args.key!r}")
        print(f"revoked {args.key}", file=sys.stderr)
    return 0


def _key_id(store: Store, key: str) -> str:
    matches = [k.key_id for k in store.list_api_keys() if key in (k.key_id, k.name) and k.revoked_at is None]
    if not matches:
        raise SystemExit(f"no active key has the id or name {key!r} (keys list shows them)")
    if len(matches) > 1:
        raise SystemExit(f"{len(matches)} active keys are named {key!r}: name one by its id (keys list)")
    return matches[0]


def _show_limits(store: Store, key_id: str) -> None:
    """A key's limits: its own, or the server's default (which `serve --key-limit` may change)."""
    own = store.api_key_limits(key_id)
    print(key_id)
    for name, field in Limits.model_fields.items():
        if name in own:
            print(f"  {name:18} {own[name]}  (this key's own)")
        else:
            shown = DERIVED.get(name, field.default)
            print(f"  {name:18} {shown}  (the server's default, unless serve --key-limit {name}=... sets another)")
