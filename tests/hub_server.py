"""A local stand-in for the Hugging Face Hub, for tests that publish and download without a network.

`LocalHub` serves, from memory, the part of the Hub HTTP protocol that `huggingface_hub` uses to
publish a model and read it back:

- accounts: `whoami-v2` (any bearer token is accepted and belongs to one user);
- repositories: `repos/create` (409 when it exists), repo info (`/api/models/{id}[/revision/{rev}]`),
  the tree listing (`/api/models/{id}/tree/{rev}[/{path}]`), `validate-yaml` for README front matter;
- uploads: `preupload` (regular or LFS mode, remote oids for unchanged-file detection), the LFS batch
  API with the basic transfer (a PUT to a URL the server hands out) and its verify step, and the
  ndjson `commit` endpoint (`header`, `file`, `lfsFile`, `deletedFile`, `deletedFolder`);
- downloads: `/{id}/resolve/{rev}/{path}` (GET and HEAD, with ETag, X-Repo-Commit, Content-Length
  and byte ranges), which is what `hf_hub_download`, `snapshot_download` and `ModelCard.load` need.

Failure modes for tests of failed uploads: set `fail_commits` (the commit endpoint answers
`failure_status` and leaves the repository untouched) or `fail_lfs_uploads` (the LFS PUT does).
`huggingface_hub` retries 500 on LFS PUTs with backoff (about 20 s), so a test of the LFS failure
should set `failure_status` to a status it does not retry, such as 507.

`huggingface_hub` reads its configuration (HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE, HF_HUB_DISABLE_XET, ...) from
the environment once, when it is imported; only the token (HF_TOKEN) is read at call time. So the test session
configures its Hub before anything imports the library: tests/conftest.py calls `configure_session()` first, which
starts one `LocalHub` for the whole session and points HF_ENDPOINT at it, with a temporary HF_HOME (cache, token
files) and offline mode off: every Hub request of the session, from any test or subprocess, reaches this server and
nothing reaches the network. No library state is patched.

The `hub_server` fixture empties the session's server, sets HF_TOKEN=`FAKE_TOKEN`, and cleans up after the test
(repositories, failure switches, stored token files). A test module uses it with
`from hub_server import hub_server` (tests/ is on sys.path under pytest's default import mode).
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import yaml

logger = logging.getLogger(__name__)

FAKE_TOKEN = "hf_localHubTestToken9f3c1a7e5b2d4086"
USER = "test-user"

# Files stored through LFS whatever their size, as a Hub repo's default .gitattributes does.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".onnx", ".msgpack", ".gguf", ".npy", ".npz")
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIXES = {"model": "", "dataset": "datasets/", "space": "spaces/"}

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_API_REPO = rf"^/api/(?P<kind>models|datasets|spaces)/{_REPO}"
_ROUTES = [
    ("GET", re.compile(r"^/api/whoami-v2$"), "whoami"),
    ("POST", re.compile(r"^/api/repos/create$"), "create_repo"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    ("GET", re.compile(rf"{_API_REPO}(?:/revision/(?P<rev>[^/]+))?$"), "repo_info"),
    ("GET", re.compile(rf"{_API_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?$"), "tree"),
    ("POST", re.compile(rf"{_API_REPO}/preupload/(?P<rev>[^/]+)$"), "preupload"),
    ("POST", re.compile(rf"{_API_REPO}/commit/(?P<rev>[^/]+)$"), "commit"),
    ("POST", re.compile(rf"^/(?:(?P<kind>datasets|spaces)/)?{_REPO}\.git/info/lfs/objects/batch$"), "lfs_batch"),
    ("PUT", re.compile(r"^/lfs/upload/(?P<oid>[0-9a-f]{64})$"), "lfs_upload"),
    ("POST", re.compile(r"^/lfs/verify/(?P<oid>[0-9a-f]{64})$"), "lfs_verify"),
    ("GET", re.compile(rf"^/(?:(?P<kind>datasets|spaces)/)?{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
]


def _git_blob_oid(data: bytes) -> str:
    """Git's object id of a blob: sha1 over the header `blob <size>\\0` and the content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


@dataclass(frozen=True)
class StoredFile:
    content: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def pointer(self) -> bytes:
        """The git-lfs pointer that git stores in place of an LFS file."""
        return (
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.content)}\n".encode()
        )

    @property
    def blob_id(self) -> str:
        return _git_blob_oid(self.pointer if self.lfs else self.content)

    @property
    def etag(self) -> str:
        """What the Hub sends as ETag on /resolve: the sha256 for LFS files, the git blob id otherwise."""
        return self.sha256 if self.lfs else self.blob_id

    def tree_entry(self, path: str) -> dict:
        entry = {"type": "file", "oid": self.blob_id, "size": len(self.content), "path": path}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": len(self.content), "pointerSize": len(self.pointer)}
        return entry


@dataclass(frozen=True)
class Commit:
    oid: str
    title: str
    description: str
    date: str
    files: dict[str, StoredFile]


@dataclass
class Repo:
    repo_id: str
    repo_type: str
    private: bool
    created_at: str
    commits: list[Commit] = field(default_factory=list)

    @property
    def head(self) -> Commit:
        return self.commits[-1]

    def resolve(self, revision: str) -> Commit | None:
        """The commit a revision names: the branch `main` or a commit id."""
        if revision == "main":
            return self.head
        return next((c for c in self.commits if c.oid == revision), None)

    def add_commit(self, title: str, description: str, files: dict[str, StoredFile]) -> Commit:
        parent = self.commits[-1].oid if self.commits else ""
        digest = hashlib.sha1(f"{parent}\n{title}\n{len(self.commits)}".encode())
        for path in sorted(files):
            digest.update(f"{path}:{files[path].blob_id}".encode())
        commit = Commit(digest.hexdigest(), title, description, _now(), dict(files))
        self.commits.append(commit)
        return commit


class HubError(Exception):
    """An error answer: HTTP status, message, and the X-Error-Code that `huggingface_hub` maps to its errors."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class LocalHub:
    """An in-memory Hub served over HTTP on 127.0.0.1 (a free port) from a background thread."""

    def __init__(self, *, fail_commits: bool = False, fail_lfs_uploads: bool = False, failure_status: int = 500):
        self.fail_commits = fail_commits
        self.fail_lfs_uploads = fail_lfs_uploads
        self.failure_status = failure_status
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.lfs_uploads: list[str] = []  # oid of every accepted LFS PUT, in order
        self.tokens_seen: set[str] = set()
        self.lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # lifecycle
    def reset(self) -> None:
        """Forget every repository, object and token seen; failure switches off."""
        with self.lock:
            self.fail_commits = self.fail_lfs_uploads = False
            self.failure_status = 500
            self.repos.clear()
            self.lfs_objects.clear()
            self.lfs_uploads.clear()
            self.tokens_seen.clear()

    def start(self) -> LocalHub:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.hub = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = self._thread = None

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # inspection helpers for tests
    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        return self.repos[(repo_type, repo_id)]

    def commit_count(self, repo_id: str, repo_type: str = "model") -> int:
        with self.lock:
            return len(self.repo(repo_id, repo_type).commits)

    def head(self, repo_id: str, repo_type: str = "model") -> Commit:
        with self.lock:
            return self.repo(repo_id, repo_type).head

    def read(self, repo_id: str, path: str, repo_type: str = "model") -> bytes:
        return self.head(repo_id, repo_type).files[path].content

    # request handling
    def find_repo(self, kind: str | None, repo_id: str, token: str | None) -> Repo:
        repo_type = REPO_TYPES.get(kind or "models", "model")
        repo = self.repos.get((repo_type, repo_id))
        if repo is None or (repo.private and token is None):
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def find_commit(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(unquote(revision))
        if commit is None:
            raise HubError(404, f"Invalid rev id: {unquote(revision)}", "RevisionNotFound")
        return commit

    def url(self, repo: Repo) -> str:
        return f"{self.endpoint}/{URL_PREFIXES[repo.repo_type]}{repo.repo_id}"


def _require_token(token: str | None) -> str:
    if token is None:
        raise HubError(401, "Invalid username or password.")
    return token


def _front_matter(readme: bytes) -> dict:
    match = re.match(rb"^---\s*\n(.*?)\n---\s*(\n|$)", readme, flags=re.DOTALL)
    if match is None:
        return {}
    data = yaml.safe_load(match.group(1)) or {}
    if not isinstance(data, dict):
        raise ValueError("metadata block is not a mapping")
    return data


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 10  # an idle keep-alive connection is closed after this many seconds

    def log_message(self, format: str, *args) -> None:
        logger.debug("local hub: " + format, *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("GET", head=True)

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    # plumbing
    def _dispatch(self, method: str, head: bool = False) -> None:
        hub: LocalHub = self.server.hub  # type: ignore[attr-defined]
        self.body = self._read_body()
        url = urlsplit(self.path)
        self.query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        auth = self.headers.get("Authorization", "")
        self.token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        if self.token is not None:
            hub.tokens_seen.add(self.token)
        for route_method, pattern, name in _ROUTES:
            match = pattern.match(url.path)
            if match and route_method == method:
                try:
                    with hub.lock:
                        status, payload, headers = getattr(self, f"_{name}")(hub, **match.groupdict())
                except HubError as err:
                    status, payload, headers = err.status, {"error": err.message}, dict(err.headers)
                    if err.code:
                        headers["X-Error-Code"] = err.code
                    headers["X-Error-Message"] = err.message
                except (KeyError, TypeError, ValueError) as err:  # a malformed request; 400 is not retried
                    status, payload, headers = 400, {"error": f"bad request: {err!r}"}, {}
                self._send(status, payload, headers, head)
                return
        self._send(404, {"error": f"no route for {method} {url.path}"}, {}, head)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, payload: dict | list | bytes, headers: dict, head: bool) -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        if not isinstance(payload, bytes):
            self.send_header("Content-Type", "application/json")
        for key, value in headers.items():
            self.send_header(key, str(value))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self) -> dict:
        try:
            return json.loads(self.body or b"{}")
        except json.JSONDecodeError as err:
            raise HubError(400, f"invalid JSON body: {err}") from err

    # accounts and repositories
    def _whoami(self, hub: LocalHub) -> tuple:
        _require_token(self.token)
        user = {"type": "user", "name": USER, "fullname": "Test User", "orgs": []}
        user["auth"] = {"type": "access_token", "accessToken": {"displayName": "tests", "role": "write"}}
        return 200, user, {}

    def _create_repo(self, hub: LocalHub) -> tuple:
        _require_token(self.token)
        payload = self._json()
        repo_type = payload.get("type") or "model"
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        if (repo_type, repo_id) in hub.repos:
            repo = hub.repos[(repo_type, repo_id)]
            return 409, {"error": "You already created this model repo", "url": hub.url(repo)}, {}
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        repo = Repo(repo_id, repo_type, private, _now())
        attributes = "".join(f"*{suffix} filter=lfs diff=lfs merge=lfs -text\n" for suffix in LFS_SUFFIXES)
        repo.add_commit("initial commit", "", {".gitattributes": StoredFile(attributes.encode(), lfs=False)})
        hub.repos[(repo_type, repo_id)] = repo
        return 200, {"url": hub.url(repo), "name": repo_id, "id": repo_id}, {}

    def _validate_yaml(self, hub: LocalHub) -> tuple:
        content = self._json().get("content", "")
        try:
            _front_matter(content.encode())
        except (yaml.YAMLError, ValueError) as err:
            return 400, {"errors": [{"message": f"invalid YAML metadata: {err}"}], "warnings": []}, {}
        return 200, {"errors": [], "warnings": []}, {}

    def _repo_info(self, hub: LocalHub, kind: str, repo: str, rev: str | None = None) -> tuple:
        stored = hub.find_repo(kind, repo, self.token)
        commit = hub.find_commit(stored, rev or "main")
        card = _front_matter(commit.files["README.md"].content) if "README.md" in commit.files else {}
        siblings = []
        for path, file in sorted(commit.files.items()):
            sibling = {"rfilename": path}
            if self.query.get("blobs") in ("True", "true", "1"):
                entry = file.tree_entry(path)
                sibling.update(size=entry["size"], blobId=entry["oid"])
                if "lfs" in entry:
                    sibling["lfs"] = {"size": entry["lfs"]["size"], "sha256": entry["lfs"]["oid"]}
                    sibling["lfs"]["pointerSize"] = entry["lfs"]["pointerSize"]
            siblings.append(sibling)
        info = {
            "_id": hashlib.sha1(repo.encode()).hexdigest()[:24],
            "id": stored.repo_id,
            "author": stored.repo_id.split("/")[0],
            "sha": commit.oid,
            "lastModified": commit.date,
            "createdAt": stored.created_at,
            "private": stored.private,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": card.get("tags", []),
            "siblings": siblings,
        }
        if card:
            info["cardData"] = card
            info.update({key: card[key] for key in ("library_name", "pipeline_tag") if key in card})
        return 200, info, {}

    def _tree(self, hub: LocalHub, kind: str, repo: str, rev: str, path: str | None = None) -> tuple:
        commit = hub.find_commit(hub.find_repo(kind, repo, self.token), rev)
        prefix = f"{unquote(path).strip('/')}/" if path else ""
        recursive = self.query.get("recursive") in ("True", "true", "1")
        entries: dict[str, dict] = {}
        for file_path, file in sorted(commit.files.items()):
            if not file_path.startswith(prefix):
                continue
            parts = file_path[len(prefix) :].split("/")
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                folder = prefix + "/".join(parts[:depth])
                entries[folder] = {
                    "type": "directory",
                    "oid": _git_blob_oid(folder.encode()),
                    "size": 0,
                    "path": folder,
                }
            if recursive or len(parts) == 1:
                entries[file_path] = file.tree_entry(file_path)
        if prefix and not entries:
            raise HubError(404, f"{prefix} does not exist on {rev}", "EntryNotFound")
        return 200, [entries[key] for key in sorted(entries)], {}

    # uploads
    def _preupload(self, hub: LocalHub, kind: str, repo: str, rev: str) -> tuple:
        _require_token(self.token)
        commit = hub.find_commit(hub.find_repo(kind, repo, self.token), rev)
        answers = []
        for item in self._json().get("files", []):
            path, size = item["path"], int(item["size"])
            sample = base64.b64decode(item.get("sample", ""))
            lfs = path.endswith(LFS_SUFFIXES) or size >= LFS_SIZE_THRESHOLD or b"\0" in sample
            existing = commit.files.get(path)
            oid = None if existing is None else (existing.sha256 if existing.lfs else existing.blob_id)
            answers.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        return 200, {"files": answers, "commitOid": commit.oid}, {}

    def _lfs_batch(self, hub: LocalHub, kind: str | None, repo: str) -> tuple:
        _require_token(self.token)
        hub.find_repo(kind, repo, self.token)
        request = self._json()
        if request.get("operation") != "upload" or "basic" not in request.get("transfers", ["basic"]):
            raise HubError(400, "only uploads with the basic transfer are supported")
        objects = []
        for obj in request.get("objects", []):
            oid, size = obj["oid"], int(obj["size"])
            answer = {"oid": oid, "size": size}
            stored = hub.lfs_objects.get(oid)
            if stored is None or len(stored) != size:
                answer["authenticated"] = True
                answer["actions"] = {
                    "upload": {"href": f"{hub.endpoint}/lfs/upload/{oid}", "header": {}},
                    "verify": {"href": f"{hub.endpoint}/lfs/verify/{oid}", "header": {}},
                }
            objects.append(answer)
        return 200, {"transfer": "basic", "objects": objects}, {"Content-Type": "application/vnd.git-lfs+json"}

    def _lfs_upload(self, hub: LocalHub, oid: str) -> tuple:
        if hub.fail_lfs_uploads:
            raise HubError(hub.failure_status, "LFS storage is failing (test failure mode)")
        if hashlib.sha256(self.body).hexdigest() != oid:
            raise HubError(400, "uploaded content does not match its sha256 oid")
        hub.lfs_objects[oid] = self.body
        hub.lfs_uploads.append(oid)
        return 200, b"", {}

    def _lfs_verify(self, hub: LocalHub, oid: str) -> tuple:
        if len(hub.lfs_objects.get(oid, b"")) != int(self._json().get("size", -1)):
            raise HubError(404, f"LFS object {oid} was not uploaded")
        return 200, {"success": True}, {}

    def _commit(self, hub: LocalHub, kind: str, repo: str, rev: str) -> tuple:
        _require_token(self.token)
        stored = hub.find_repo(kind, repo, self.token)
        parent = hub.find_commit(stored, rev)
        if unquote(rev) != "main":
            raise HubError(400, "commits are only accepted on the branch main")
        if hub.fail_commits:
            raise HubError(hub.failure_status, "Internal Error (test failure mode)")
        lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header" or not lines[0]["value"].get("summary"):
            raise HubError(400, "a commit starts with a header line carrying a summary")
        header = lines[0]["value"]
        if header.get("parentCommit") not in (None, parent.oid):
            raise HubError(412, "parentCommit is not the head of main")
        files = dict(parent.files)
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            if key == "file":
                files[value["path"]] = StoredFile(base64.b64decode(value["content"]), lfs=False)
            elif key == "lfsFile":
                content = hub.lfs_objects.get(value["oid"])
                if content is None:
                    raise HubError(422, f"LFS object {value['oid']} for {value['path']} was never uploaded")
                files[value["path"]] = StoredFile(content, lfs=True)
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
            elif key == "deletedFolder":
                folder = value["path"].rstrip("/") + "/"
                files = {path: file for path, file in files.items() if not path.startswith(folder)}
            else:
                raise HubError(400, f"unknown commit operation {key!r}")
        commit = stored.add_commit(header["summary"], header.get("description", ""), files)
        answer = {"success": True, "commitOid": commit.oid, "commitUrl": f"{hub.url(stored)}/commit/{commit.oid}"}
        answer.update(hookOutput="", pullRequestUrl=None)
        return 200, answer, {}

    # downloads
    def _resolve(self, hub: LocalHub, kind: str | None, repo: str, rev: str, path: str) -> tuple:
        commit = hub.find_commit(hub.find_repo(kind, repo, self.token), rev)
        file = commit.files.get(unquote(path))
        if file is None:
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        headers = {"ETag": f'"{file.etag}"', "X-Repo-Commit": commit.oid, "Accept-Ranges": "bytes"}
        headers["Content-Type"] = "application/octet-stream"
        if file.lfs:
            headers.update({"X-Linked-Etag": f'"{file.sha256}"', "X-Linked-Size": len(file.content)})
        content, status = file.content, 200
        ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if ranged:
            start = int(ranged.group(1))
            end = int(ranged.group(2)) if ranged.group(2) else len(content) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(content)}"
            content, status = content[start : end + 1], 206
        return status, content, headers


#: The session's Hub (`configure_session`), None until it is configured.
SESSION_HUB: LocalHub | None = None
#: Environment variables that would send the session elsewhere or read the user's own Hub state.
_CLEARED = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_TOKEN_PATH",
    "HF_OIDC_RESOURCE",
    "HF_OIDC_ID_TOKEN",
    "HUGGINGFACE_CO_STAGING",
    "HUGGINGFACE_HUB_CACHE",
    "HF_XET_CACHE",
)


def configure_session() -> LocalHub:
    """Start the session's `LocalHub` and point `huggingface_hub` (and Transformers, and every subprocess) at it
    through the environment: HF_ENDPOINT, a temporary HF_HOME and HF_HUB_CACHE, HF_HUB_DISABLE_XET=1, telemetry off,
    127.0.0.1 in NO_PROXY, offline mode and the user's tokens unset. Must run before `huggingface_hub` is imported
    (the library reads these once, at import); the server and the folder go at interpreter exit."""
    global SESSION_HUB
    if SESSION_HUB is not None:
        return SESSION_HUB
    if "huggingface_hub" in sys.modules:
        raise RuntimeError(
            "hub_server.configure_session() must run before huggingface_hub is imported (it reads HF_ENDPOINT and "
            "HF_HOME once, at import): call it at the top of tests/conftest.py"
        )
    hub = LocalHub().start()
    home = tempfile.mkdtemp(prefix="relational_hf_test_hf_home_")
    atexit.register(shutil.rmtree, home, True)
    atexit.register(hub.stop)
    for name in _CLEARED:
        os.environ.pop(name, None)
    os.environ.update(
        HF_ENDPOINT=hub.endpoint,
        HF_HOME=home,
        HF_HUB_CACHE=os.path.join(home, "hub"),
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    for name in ("NO_PROXY", "no_proxy"):
        os.environ[name] = ",".join(filter(None, [*os.environ.get(name, "").split(","), "127.0.0.1"]))
    SESSION_HUB = hub
    return hub


@pytest.fixture
def hub_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalHub]:
    """The session's `LocalHub`, emptied, with HF_TOKEN=`FAKE_TOKEN` (read by `huggingface_hub` at call time).

    After the test: the server is emptied again and the token files a test may have written into the session's
    temporary HF_HOME are removed."""
    from huggingface_hub import close_session, constants

    hub = SESSION_HUB
    if hub is None or constants.ENDPOINT != hub.endpoint:
        raise RuntimeError(
            "the session's Hub is not configured: tests/conftest.py must call hub_server.configure_session() before "
            f"huggingface_hub is imported (huggingface_hub talks to {constants.ENDPOINT})"
        )
    hub.reset()
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    close_session()  # public: the next request opens a fresh client (no connection kept from an earlier test)
    try:
        yield hub
    finally:
        close_session()  # closes keep-alive connections so the handler threads end
        hub.reset()
        for path in (constants.HF_TOKEN_PATH, constants.HF_STORED_TOKENS_PATH):
            if os.path.isfile(path) and os.path.commonpath([path, constants.HF_HOME]) == constants.HF_HOME:
                os.remove(path)  # only inside the session's temporary HF_HOME
