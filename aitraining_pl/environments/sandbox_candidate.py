"""The candidate side of the code sandbox (see ``aitraining_pl.environments.sandbox``).

The supervisor runs this file's text with ``python -I -S -u -c`` as the candidate process, with the request and
reply pipe descriptors as arguments: it loads the model's code, then serves calls, attribute and item reads
on its objects. It only ever sees call arguments, never the tests; replies are plain data (a Python literal)
or a handle to an object. Nothing here is trusted: the candidate's code can change all of it.
"""

import ast
import json
import os
import socket
import sys


def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the code sandbox")


for _name in ("socket", "create_connection", "getaddrinfo", "socketpair", "fromfd", "create_server"):
    setattr(socket, _name, _no_network)


def _plain(value, depth=0):
    kind = type(value)
    if kind in (int, bool, float, complex, str, bytes, type(None)):
        return True
    if depth > 50:
        return False
    if kind in (list, tuple, set):
        return all(_plain(v, depth + 1) for v in value)
    return kind is dict and all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())


def _serve(requests, replies):
    handles = []

    def encode(value):
        try:
            if _plain(value):
                text = repr(value)
                ast.literal_eval(text)
                return {"value": text}
        except Exception:
            pass
        handles.append(value)
        return {"ref": len(handles) - 1}

    def decode(item):
        return handles[item["ref"]] if "ref" in item else ast.literal_eval(item["value"])

    def send(message):
        replies.write(json.dumps(message).encode() + b"\n")
        replies.flush()

    namespace = {"__name__": "__candidate__"}
    try:
        exec(compile(json.loads(requests.readline()), "<candidate>", "exec"), namespace)
    except BaseException as exc:
        send({"raise": type(exc).__name__, "message": str(exc)[:500]})
        return
    send({"names": {k: encode(v) for k, v in list(namespace.items()) if not k.startswith("__")}})
    for line in requests:
        request = json.loads(line)
        try:
            target = handles[request["ref"]]
            if request["op"] == "call":
                kwargs = {k: decode(v) for k, v in request["kwargs"].items()}
                result = target(*[decode(a) for a in request["args"]], **kwargs)
            elif request["op"] == "getattr":
                result = getattr(target, request["name"])
            else:
                result = target[decode(request["key"])]
            send({"ok": encode(result)})
        except BaseException as exc:
            send({"raise": type(exc).__name__, "message": str(exc)[:500]})


if __name__ == "__main__":
    _serve(os.fdopen(int(sys.argv[1]), "rb"), os.fdopen(int(sys.argv[2]), "wb"))
