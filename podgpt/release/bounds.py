"""What keeps a client of the server (serve.py) from holding it: the JSON error a request gets,
uvicorn's connection with the bounds it lacks (a request's time, its head, its body's length), and
the bounded line of requests for the one model."""

import collections
import contextlib
import http
import json
import math
import re
import sys
import threading
import time

from fastapi.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import get_path_with_query_string

from podgpt.core.util import first_line

MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused unread


class RequestError(Exception):
    """A request refused: one line naming the problem and the fix; the field, status, headers."""

    def __init__(self, message, param=None, status=400, headers=None):
        super().__init__(message)
        self.param, self.status, self.headers = param, status, headers


def shown(value, width=40):
    """A client's value as JSON, cut short: a request must not make the reply (or the log) huge."""
    text = json.dumps(value)
    return text if len(text) <= width else f"{text[:width]}... ({len(text)} characters)"


class ModelQueue:
    """The model, for one generation at a time, first come first served; at most max_waiting wait,
    each at most max_wait seconds, or get 503 with a Retry-After (limit_concurrency has none)."""

    def __init__(self, max_waiting, max_wait):
        self.max_waiting, self.max_wait = max_waiting, max_wait
        self.cond = threading.Condition()
        self.line = collections.deque()  # the waiting requests, first come first
        self.started = None  # when the running generation took the model; None: the model is free
        self.held = collections.deque(maxlen=16)  # seconds each of the last requests held it
        self.closed = False  # the server is stopping: no generation starts

    def free(self):
        return self.started is None and not self.closed

    @contextlib.contextmanager
    def turn(self):
        with self.cond:
            if len(self.line) + (not self.free()) > self.max_waiting:
                raise self.refusal(f"the model is busy and its line is full ({len(self.line)} "
                                   "waiting: serve_max_queue)")
            me = object()
            self.line.append(me)
            if not self.cond.wait_for(lambda: self.line[0] is me and self.free(), self.max_wait):
                self.line.remove(me)
                self.cond.notify_all()  # the next one may be first in line now
                raise self.refusal(f"the model was not free within {self.max_wait} s "
                                   "(serve_max_wait)")
            self.line.popleft()
            self.started = time.monotonic()
        try:
            yield
        finally:
            with self.cond:
                self.held.append(time.monotonic() - self.started)
                self.started = None
                self.cond.notify_all()

    def refusal(self, why):
        """The 503; Retry-After: when the requests ahead would be done at the mean time the last
        ones held the model (before any ended: the running one's time so far), at least 1 s."""
        now = time.monotonic()
        per_request = sum(self.held) / len(self.held) if self.held else now - (self.started or now)
        seconds = max(1, math.ceil(per_request * (len(self.line) + (self.started is not None))))
        return RequestError(f"{why}: send it again in {seconds} s", status=503,
                            headers={"Retry-After": str(seconds)})

    def close(self, timeout):
        """Lets no generation start; waits up to timeout s for the running one: whether it ended."""
        with self.cond:
            self.closed = True
            return self.cond.wait_for(lambda: self.started is None, timeout)


# --- the HTTP layer

def log(client, message):
    """One write, so that threads' lines do not interleave; client: (host, port) or None."""
    when, who = time.strftime("%d/%b/%Y %H:%M:%S"), client[0] if client else "-"
    sys.stderr.write(f"{who} - - [{when}] {message}\n")  # stderr is line-buffered


def json_reply(status, obj, headers=None):
    """obj as json.dumps writes it (a log-probability of -inf too, as -Infinity)."""
    return Response(json.dumps(obj), status, headers, media_type="application/json")


def error_reply(e):
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return json_reply(e.status, {"error": {"message": str(e), "type": kind, "param": e.param}},
                      e.headers)


def length_error(size):
    """RequestError for a Content-Length (text) that is not a size or is over MAX_BODY_BYTES."""
    if not (size.isascii() and size.isdigit()):  # isdigit() alone passes "²", which int() refuses
        return RequestError(f"Content-Length {shown(size)} is not a size in bytes: send its length")
    if len(size) > 9 or int(size) > MAX_BODY_BYTES:  # int() refuses thousands of digits
        return RequestError(f"Content-Length {shown(size)} is above this server's limit of "
                            f"{MAX_BODY_BYTES} bytes: send a shorter prompt", status=413)
    return None


class Connection(H11Protocol):
    """uvicorn's connection (h11), one request each, with what uvicorn lacks: a request arrives
    within read_timeout seconds (uvicorn bounds a head's size, not its time); a head h11 refuses
    gets the JSON error (not plain text); a body cut short by EOF gets 400 (not a dropped line)."""

    def __init__(self, *args, read_timeout, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout, self.head = read_timeout, b""  # head: the bytes before h11's request
        self.timer = self.loop.call_later(read_timeout, self.too_slow)

    def connection_lost(self, exc):
        self.timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data):
        if self.cycle is None:
            self.head += data
        elif not self.cycle.more_body:
            return  # bytes after the request, unread: h11 would pause reading, blind to a leaving
        super().data_received(data)

    def eof_received(self):
        if self.cycle is None or not self.cycle.more_body:
            return False  # the connection closes: its client has left, its generation stops
        self.cycle.more_body = False  # a body cut short ends here, and gets the app's 400
        self.cycle.message_event.set()
        return True

    def too_slow(self):
        if self.cycle is None:
            self.transport.close()  # its head never came whole: dropped unanswered
        elif self.cycle.more_body:  # its body never did: 408, and its handler sees the client gone
            self.refuse(RequestError(f"the request did not arrive within {self.read_timeout} s "
                                     "(serve_read_timeout): send it at once", status=408))

    def send_400_response(self, msg):
        """h11 refused the request's head: the JSON error, naming the bad Content-Length or h11's
        reason."""
        size = re.search(rb"(?im)^content-length:(.*)$", self.head)
        error = size and length_error(size[1].strip().decode("latin-1"))
        reason = first_line(sys.exc_info()[1])[:80]  # h11's reason may quote the request at length
        self.refuse(error or RequestError(f"the request is not HTTP that h11 reads ({reason}): "
                                          "send a well-formed HTTP/1.1 request"))

    def refuse(self, error):
        """Answers error past h11, which writes HTTP/1.1 alone: in the client's version."""
        line = self.head.split(b"\n", 1)[0].strip().decode("latin-1")
        version, body = "1.0" if line.endswith("HTTP/1.0") else "1.1", error_reply(error).body
        self.transport.write(f"HTTP/{version} {error.status} {http.HTTPStatus(error.status).phrase}"
                             f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
                             "\r\nConnection: close\r\n\r\n".encode() + body)
        self.transport.close()
        log(self.client, f'"{line}" {error.status} -')


def logged(app):
    """app, logging each reply's status (uvicorn's access log leaves out a client already gone)."""
    async def app_logged(scope, receive, send):
        async def send_logged(message):
            if message["type"] == "http.response.start":
                line = f'{scope["method"]} {get_path_with_query_string(scope)}'
                log(scope["client"], f'"{line} HTTP/{scope["http_version"]}" {message["status"]} -')
            await send(message)
        await app(scope, receive, send_logged)
    return app_logged

