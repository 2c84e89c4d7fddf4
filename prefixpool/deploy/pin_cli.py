"""`prefixpool pin`: pin (or, with --unpin, release) a prefix on the workers, through the router.

    prefixpool pin --router http://127.0.0.1:8000 --text "You are ..." --ttl-s 3600
    prefixpool pin --router URL --tokens 1,2,3,... --cache-salt tenant-a --unpin

Sends POST (or DELETE) /v1/admin/pin with the router's API key, prints the
JSON answer (per worker: blocks pinned now, or the error). Knows nothing of
workers: the router forwards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", required=True, help="router base URL, e.g. http://127.0.0.1:8000")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="the prefix as text (tokenized by the router)")
    source.add_argument("--tokens", help="the prefix as comma-separated token ids")
    parser.add_argument("--ttl-s", type=float, default=300.0, help="how long the pin lasts")
    parser.add_argument("--cache-salt", default="", help="the tenant's cache_salt (pins are per salt)")
    parser.add_argument("--scope", choices=("all", "holders"), default="all", help="which workers to pin on")
    parser.add_argument("--name", default="", help="pin name (default: the prefix's last block key)")
    parser.add_argument("--unpin", action="store_true", help="release the pin instead")
    parser.add_argument("--api-key", default=os.environ.get("PREFIXPOOL_API_KEY", ""),
                        help="router API key (env PREFIXPOOL_API_KEY)")


def run(args: argparse.Namespace) -> int:
    body = {"ttl_s": args.ttl_s, "cache_salt": args.cache_salt, "scope": args.scope, "name": args.name}
    if args.text is not None:
        body["text"] = args.text
    else:
        body["tokens"] = [int(t) for t in args.tokens.split(",") if t.strip()]
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    request = urllib.request.Request(f"{args.router.rstrip('/')}/v1/admin/pin", data=json.dumps(body).encode(),
                                     headers=headers, method="DELETE" if args.unpin else "POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            print(json.dumps(json.load(reply), indent=2))
            return 0
    except urllib.error.HTTPError as err:
        print(err.read().decode(errors="replace"), file=sys.stderr)
        return 1
    except urllib.error.URLError as err:
        print(f"cannot reach {args.router}: {err.reason}", file=sys.stderr)
        return 1
