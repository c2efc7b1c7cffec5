"""A TLS terminator for tests: accepts TLS on 127.0.0.1:<listen> with the
given certificate and key, and pipes each connection to 127.0.0.1:<target>
in plain TCP. It stands in for a provider's HTTPS front (issue 28 #11):
the router's TLS client, its roots and HIVENET_ROUTER_PROVIDER_CA_FILE are
tested against it.

usage: tls_proxy.py LISTEN_PORT TARGET_PORT CERT_PEM KEY_PEM
"""
import asyncio
import ssl
import sys


async def pipe(reader, writer):
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        try:
            writer.close()
        except Exception:
            pass


async def main():
    listen, target, cert, key = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)

    async def serve(cr, cw):
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            cw.close()
            return
        await asyncio.gather(pipe(cr, uw), pipe(ur, cw))

    server = await asyncio.start_server(serve, "127.0.0.1", listen, ssl=ctx)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


asyncio.run(main())
