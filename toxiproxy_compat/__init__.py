"""A Toxiproxy-compatible fault-injection server, standard library only.

The chaos suite drives network faults through Toxiproxy's HTTP API. Where no real
Toxiproxy is at hand (no binary, no Docker), this module stands in for it:

    python -m toxiproxy_compat --host 127.0.0.1 --port 8474

runs it in the foreground and prints one line, ``toxiproxy_compat listening on
http://HOST:PORT``, on stdout once the API answers (``--port 0`` picks a free port).
``ToxiproxyServer(host, port)`` runs the same server on a thread in this process.

HTTP API (JSON, as Toxiproxy 2.x serves it)
-------------------------------------------
- ``GET /version``; ``POST /reset`` (enable every proxy, remove every toxic).
- ``GET /proxies`` (name -> proxy with its toxics); ``POST /proxies`` (``name``,
  ``upstream``, ``listen``, ``enabled``): 201; a ``listen`` port of 0 picks a free port
  and the answer shows the real one. ``POST /populate`` (a list; a proxy of the same
  name is kept if its listen and upstream match, else replaced): 201 ``{"proxies": [...]}``.
- ``GET``, ``POST``/``PATCH`` (update ``listen``, ``upstream``, ``enabled``), ``DELETE``
  ``/proxies/{proxy}``. Disabling closes every connection and stops listening;
  enabling listens again on the same address.
- ``GET``/``POST /proxies/{proxy}/toxics``; ``GET``, ``POST``/``PATCH`` (``attributes``,
  ``toxicity``), ``DELETE /proxies/{proxy}/toxics/{toxic}``.
- Errors are ``{"error": ..., "status": ...}``: 409 for a duplicate proxy or toxic name,
  404 for an unknown one, 400 for a malformed body or an invalid toxic, 500 when a
  listen address cannot be bound. toxiproxy-python maps 409/404/400 to ``ProxyExists``,
  ``NotFound`` and ``InvalidToxic``.

Toxics
------
A toxic has ``name`` (default ``<type>_<stream>``), ``type``, ``stream`` (``upstream``:
client to server; ``downstream``, the default: server to client), ``toxicity`` (the
chance, decided once per connection and direction, that it applies; default 1.0) and
``attributes`` (integers; missing ones are 0). Adding a toxic applies it to open
connections too; removing it takes it off them, and data it was holding goes on at once.

- ``latency`` (``latency``, ``jitter`` ms): each chunk leaves ``latency`` +/- ``jitter``
  after it arrived; chunks do not add up their delays.
- ``timeout`` (``timeout`` ms): no data gets through; with ``timeout`` > 0 the
  connection closes that long after the toxic began on it, with 0 it stays open.
  Data arriving meanwhile is dropped, and removing the toxic closes the connections it
  was applied to: since Toxiproxy 2.1.1 (PR #168) it does exactly that, because a
  stream with a hole in it is corrupt (its README said "delayed" until PR #598 fixed
  the wording to "dropped"). To hold data and deliver it on removal, use ``latency``
  with a long delay, or ``bandwidth`` with rate 0: removing either releases what it holds.
- ``reset_peer`` (``timeout`` ms): the first data (or end of stream) is dropped and,
  ``timeout`` later, both sockets are closed with SO_LINGER 0, so each peer sees a TCP
  RST (ECONNRESET), not a clean end of stream.
- ``bandwidth`` (``rate`` KB/s, 1 KB = 1000 bytes): data is paced to the rate, in
  slices of a tenth of a second. Rate 0 lets nothing through until the toxic is removed,
  as in Toxiproxy.
- ``limit_data`` (``bytes``): after that many bytes have passed, the connection closes.
- ``slow_close`` (``delay`` ms): the close of the stream is passed on ``delay`` late.
- ``slicer`` (``average_size``, ``size_variation`` bytes, ``delay`` microseconds): each
  chunk is cut in slices of ``average_size`` +/- ``size_variation`` bytes, ``delay``
  apart.

When one direction ends (end of stream, a toxic closing it, a write failing), its
destination socket is closed; the other direction then reads an end of stream from that
same socket, passes on what it already had and closes in turn. Toxiproxy behaves so too:
it does not keep half-closed connections, and it passes on a peer's RST as a clean close.

Deviations from Toxiproxy, and why
----------------------------------
- Stricter input: unknown attribute names, attribute values that are not non-negative
  integers, a toxicity outside 0..1, a slicer ``average_size`` below 1 or a
  ``size_variation`` not below it are refused with 400. Toxiproxy ignores unknown names
  and takes the rest, which turns a typo into a silent no-op; whatever this server
  accepts, a real Toxiproxy accepts too.
- A proxy created without ``listen`` listens on ``127.0.0.1:0``, not on every interface.
- Removing a ``timeout`` toxic closes only the connections it actually applied to
  (per toxicity); Toxiproxy closes every connection of that direction.
- ``reset_peer`` sends RSTs on connections opened before the toxic was added too;
  Toxiproxy sets SO_LINGER only on connections opened after, so those end with a FIN.
- Toxicity is drawn when a toxic starts on a connection or is updated; Toxiproxy draws
  again also whenever a later toxic is added to the same direction.
- When a toxic closes a direction (timeout expiry, ``limit_data``, ``reset_peer``), a
  chunk that is still held by a later toxic of that direction is discarded; Toxiproxy
  lets it through first.
- One request per HTTP connection (``Connection: close``), ``Content-Length`` bodies
  only; no ``/metrics``, no ``-config`` file, and no HTTP-level toxics.

Concurrency: the whole server (API, listeners, every connection) runs on one asyncio
event loop, on the caller's thread in the foreground or on one thread for
``ToxiproxyServer``. Every wait can be cancelled, so disabling or deleting a proxy or
stopping the server ends all of its work at once, and nothing outlives ``stop()``.
"""

from .api import VERSION
from .server import ToxiproxyServer, main

__all__ = ["VERSION", "ToxiproxyServer", "main"]
