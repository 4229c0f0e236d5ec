"""Downloads for prepare.py's URL sources and eval.py's hub benchmarks. A file on the Hugging Face
hub (or the HF_ENDPOINT mirror) goes through huggingface_hub into its cache, which handles HF_TOKEN,
HF_HUB_OFFLINE, retries and rate limits; any other URL through requests into download_dir,
resumable and retried. A copy already in download_dir/host/path or the hub's cache is read there."""

import errno
import http.client
import os
import re
import socket
import sys
import time
import urllib.parse

from podgpt.core.owned import file_sha256
from podgpt.core.util import disk_full, fail, first_line, make_folders, remove_empty

RETRIES = 5  # download attempts per file
BACKOFF = 2.0  # seconds before the first retry, doubled after each failed attempt
TIMEOUT = (10, 60)  # download connect and read timeouts, seconds
MAX_WAIT = 300  # seconds: the longest wait a 429 or 503 may ask for

HF_DEFAULT_ENDPOINT = "https://huggingface.co"


def cache_path(url, download_dir):
    """download_dir/host/path of url: distinct URLs never share a file (HF shards share names)."""
    parts = urllib.parse.urlsplit(url)
    names = [parts.netloc] + parts.path.split("/")
    names = (re.sub(r"[^\w.-]", "_", n) for n in names if n not in ("", ".", ".."))
    return os.path.join(download_dir, *names)


def hub_file(url):
    """hf_hub_download's arguments for a file's URL on the hub or the HF_ENDPOINT mirror, e.g.
    .../datasets/owner/name/resolve/main/file; None for a URL anywhere else."""
    from huggingface_hub import constants

    tail = r"/(datasets/|spaces/)?([^/]+/[^/]+)/resolve/([^/]+)/([^?#]+)"
    for endpoint in dict.fromkeys((constants.ENDPOINT, HF_DEFAULT_ENDPOINT)):
        if match := re.match(re.escape(endpoint) + tail, url):
            kind, repo, revision, file = match.groups()
            return {"endpoint": endpoint, "repo_id": repo,
                    "repo_type": {"datasets/": "dataset", "spaces/": "space"}.get(kind, "model"),
                    "revision": urllib.parse.unquote(revision),
                    "filename": urllib.parse.unquote(file)}


def local_copy(url, download_dir):
    """url's complete copy in download_dir, else (a file on the hub) the Hugging Face cache's for
    its revision; None when neither holds it, which under HF_HUB_OFFLINE fails for the hub's."""
    path, hub = cache_path(url, download_dir), hub_file(url)
    if os.path.exists(path):
        return path
    if not hub:
        check_folders(download_dir, os.path.dirname(path))  # before a download: it goes there
        return None
    from huggingface_hub import constants, try_to_load_from_cache

    cached = try_to_load_from_cache(hub["repo_id"], hub["filename"], revision=hub["revision"],
                                    repo_type=hub["repo_type"])
    if not isinstance(cached, str) and constants.HF_HUB_OFFLINE:
        fail(f"HF_HUB_OFFLINE is set and {url} is not at {path} nor in the Hugging Face cache "
             f"({constants.HF_HUB_CACHE}): put the file there, or unset HF_HUB_OFFLINE to "
             "download it")
    return cached if isinstance(cached, str) else None


def check_folders(download_dir, folder):
    """Stop in one line when a file stands where download_dir or the folder under it must be."""
    while folder and not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    if not folder or os.path.isdir(folder):
        return
    if os.path.normpath(folder) == os.path.normpath(download_dir):
        fail(f"download_dir={download_dir} is a file, not a folder: give the path of a folder for "
             "the downloads (it is created), e.g. --download_dir=downloads")
    fail(f"download_dir={download_dir}: {folder} is a file, not a folder: move it away, or choose "
         "another --download_dir")


def hub_download(url, hub, path):
    """The file's path in the Hugging Face cache, downloaded there if need be; a failure is one line
    saying what to do (path: where download_dir would hold a copy)."""
    from huggingface_hub import constants, hf_hub_download

    try:
        return hf_hub_download(**hub)
    except Exception as e:  # huggingface_hub's errors, httpx's and OSError: many types
        if disk_full(e):
            fail(f"the disk of the Hugging Face cache ({constants.HF_HUB_CACHE}) is full "
                 f"({first_line(e)}) downloading {url}: free space on it (or set HF_HUB_CACHE to "
                 "a folder with room) and rerun the same command")
        reason, kind = failure(e)
        if kind == "retry":  # huggingface_hub retried it already
            rerun = ("rate-limited: rerun later with HF_TOKEN set (the hub's rate limits are per "
                     "token, and lowest without one)" if reason == "HTTP 429"
                     else "check the network and rerun")
            fail(f"cannot download {url} after retries ({reason}): {rerun}")
        if kind == "unreachable":
            advice = (f"offline? set HF_ENDPOINT to a mirror, or put the file at {path} or in the "
                      f"Hugging Face cache ({constants.HF_HUB_CACHE})")
        elif reason in ("HTTP 401", "HTTP 403"):
            advice = (f"set HF_TOKEN (a token with access to {hub['repo_id']}; a gated dataset's "
                      "terms accepted on its page)")
        else:
            advice = "check the URL; HF_ENDPOINT picks the Hugging Face mirror"
        fail(f"cannot download {url}: {reason}: {advice}")


def fetch(url, part):
    """Download url into the file `part`, continuing a partial one with a Range request."""
    import requests
    from tqdm import tqdm

    have = os.path.getsize(part) if os.path.exists(part) else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    with requests.get(url, headers=headers, stream=True, timeout=TIMEOUT) as r:
        if r.status_code == 416:  # the partial file is not a prefix of this file: start over
            os.remove(part)
        r.raise_for_status()
        if r.status_code != 206:  # the server sent the whole file, not the rest
            have = 0
        total = int(r.headers.get("Content-Length", 0)) + have or None
        name = os.path.basename(part)[: -len(".part")]
        with (open(part, "ab" if have else "wb") as f,
              tqdm(total=total, initial=have, unit="B", unit_scale=True, desc=name) as bar):
            for chunk in r.iter_content(chunk_size=1 << 20):
                f.write(chunk)
                bar.update(len(chunk))


def wrapped(e):
    """e and every exception inside it: requests wraps urllib3's, huggingface_hub httpx's, and those
    the socket's."""
    found, todo = [], [e]
    while todo:
        x = todo.pop()
        if isinstance(x, BaseException) and all(x is not f for f in found):
            found.append(x)
            todo += [*x.args, getattr(x, "reason", None), x.__cause__, x.__context__]
    return found


def failure(e):
    """(why a request failed, in a few words; what trying again would do): "retry" after a timeout,
    a dropped connection or a 5xx; "unreachable" (an offline pod) or "final" (a 4xx): no use."""
    import requests

    inner = wrapped(e)
    # requests' HTTPError and huggingface_hub's HfHubHTTPError carry the answer
    status = next((x.response.status_code for x in inner if getattr(x, "response", None) is not None
                   and x.response.status_code >= 400), None)
    if status:
        # retried too: 408 (timed out), 429 (a rate limit asks for a wait), 416 (fetch dropped a
        # .part that is not a prefix of the file, so the retry starts over)
        return f"HTTP {status}", "retry" if status >= 500 or status in (408, 416, 429) else "final"

    def has(*types):
        return any(isinstance(x, types) for x in inner)

    if has(ConnectionRefusedError):
        return "connection refused", "unreachable"
    if has(socket.gaierror):
        return "cannot resolve the host name", "unreachable"
    no_route = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN)
    if any(isinstance(x, OSError) and x.errno in no_route for x in inner):
        return "network unreachable", "unreachable"
    if isinstance(e, requests.Timeout) or has(TimeoutError):
        return "timed out", "retry"
    if isinstance(e, requests.exceptions.ChunkedEncodingError) or has(
            ConnectionResetError, ConnectionAbortedError, BrokenPipeError,
            http.client.IncompleteRead):
        return "connection dropped", "retry"
    return first_line(e), "final"


def fetch_retrying(url, path):
    """fetch(url, path + ".part"), retried after a failure that may pass, waiting twice as long each
    time or as long as the server asks."""
    import requests

    part = path + ".part"
    for attempt in range(1, RETRIES + 1):
        try:
            return fetch(url, part)
        except requests.RequestException as e:
            reason, kind = failure(e)
            if kind == "unreachable":
                fail(f"cannot download {url}: {reason}: offline? put the file at {path}, or check "
                     "the URL")
            if kind == "final":
                fail(f"cannot download {url}: {reason}: check the URL")
            if attempt == RETRIES:
                rerun = ("rate-limited: rerun later" if reason == "HTTP 429"
                         else "check the network and rerun")
                fail(f"cannot download {url} after {RETRIES} attempts ({reason}): {rerun}"
                     + kept_note(part))
            # a 429's or 503's Retry-After, in seconds (an HTTP-date counts as none)
            asked = e.response.headers.get("Retry-After", "") if e.response is not None else ""
            wait = max(BACKOFF * 2 ** (attempt - 1),
                       min(int(asked.strip()), MAX_WAIT) if asked.strip().isdigit() else 0)
            print(f"download of {url} failed ({reason}); retry {attempt}/{RETRIES - 1} in "
                  f"{wait:g}s", file=sys.stderr)
            time.sleep(wait)


def kept_note(part):
    """What a failure says of the bytes in part, which the rerun resumes; "" if there are none."""
    kept = os.path.getsize(part) if os.path.isfile(part) else 0
    return (f"; the {kept:,} bytes so far are kept in {part}, and the rerun resumes them"
            if kept else "")


def download(url, download_dir, sha256=""):
    """The local copy of url: download_dir's, else for a file on the hub the Hugging Face cache's,
    else fetched into download_dir; a failed fetch leaves only a .part with bytes, which a rerun
    resumes."""
    path, hub = cache_path(url, download_dir), hub_file(url)
    found = local_copy(url, download_dir) or (hub and hub_download(url, hub, path))
    if found:  # download_dir's copy (maybe the user's) or the Hugging Face cache's
        if sha256 and (actual := file_sha256(found)) != sha256.lower():
            mine = found == path
            what = path if mine else f"its copy in the Hugging Face cache ({found})"
            fix = ", or move that file away and rerun to download it again" if mine else ""
            fail(f"{url}: sha256 of {what} is {actual}, expected {sha256}: check --sha256{fix}")
        return found
    part = path + ".part"
    made = make_folders(os.path.dirname(path))
    try:
        fetch_retrying(url, path)
        if sha256 and (actual := file_sha256(part)) != sha256.lower():
            os.remove(part)  # this run's download, checked before it takes the copy's name
            fail(f"{url}: sha256 is {actual}, expected {sha256} (download deleted): "
                 "check --sha256 or the URL")
        os.replace(part, path)
    except BaseException as e:
        if os.path.isfile(part) and os.path.getsize(part) == 0:
            os.remove(part)
        remove_empty(made)
        if disk_full(e):
            fail(f"the disk of download_dir={download_dir} is full ({first_line(e)}) downloading "
                 f"{url}: free space on it and rerun the same command" + kept_note(part))
        raise
    return path
