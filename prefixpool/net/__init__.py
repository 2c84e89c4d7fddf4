"""HTTP/1.1 on asyncio, lean: the client the router calls vLLM (and etcd's JSON gateway) with, and the server
its endpoints run on. Each request is read from and written to the connection's buffer directly.

Knows nothing of what the bodies hold: no router, etcd or vLLM in here (imports the standard library only).
"""
