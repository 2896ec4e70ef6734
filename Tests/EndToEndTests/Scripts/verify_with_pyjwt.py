#!/usr/bin/env python3
"""Verifies signerd's ES256 JWS with PyJWT (and the `cryptography` package),
a verifier independent of signerd and OpenSSL's C API.

stdin: a JSON list of {"token", "audience", "public_key_pem"}.
stdout: a JSON list of {"header", "claims"} for tokens that verified;
exits 1 naming the first token that did not.
"""
import json
import sys

import jwt  # PyJWT

cases = json.load(sys.stdin)
out = []
for index, case in enumerate(cases):
    try:
        claims = jwt.decode(
            case["token"],
            case["public_key_pem"],
            algorithms=["ES256"],
            audience=case["audience"],
            options={"require": ["iss", "iat", "aud", "bid"]},
            leeway=5,
        )
        header = jwt.get_unverified_header(case["token"])
    except Exception as error:  # noqa: BLE001 - report any failure by name
        print(f"token {index} ({case['audience']}) did not verify with PyJWT {jwt.__version__}: {type(error).__name__}: {error}", file=sys.stderr)
        sys.exit(1)
    out.append({"header": header, "claims": claims})
json.dump(out, sys.stdout)
