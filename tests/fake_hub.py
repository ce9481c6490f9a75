"""A Hugging Face Hub on 127.0.0.1 for the tests: the few routes huggingface_hub's snapshot_download
calls (repository info at a revision, the file tree, each file by HEAD and GET), serving repositories
held in memory. Point HF_ENDPOINT at `url`. Every request is recorded with its Authorization header,
so a test can see which files were fetched and which token was sent."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class Repo:
    """One model repository: revision name -> {path: bytes}; each revision has its own commit id."""

    def __init__(self, revisions: dict[str, dict[str, bytes]], token: str | None = None):
        self.revisions = revisions
        self.token = token  # None: public; else the only Bearer token that opens it
        self.commits = {
            name: hashlib.sha1(name.encode() + json.dumps(sorted(files)).encode()).hexdigest()
            for name, files in revisions.items()
        }

    @classmethod
    def from_dir(cls, path: Path, extra: dict[str, bytes] | None = None, **kw) -> Repo:
        files = {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}
        return cls({"main": {**files, **(extra or {})}}, **kw)

    def revision(self, name: str) -> tuple[str, dict[str, bytes]] | None:
        for rev, commit in self.commits.items():
            if name in (rev, commit):
                return commit, self.revisions[rev]
        return None


class FakeHub:
    def __init__(self, repos: dict[str, Repo]):
        self.repos, self.requests = repos, []  # (method, path, Authorization header)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub._serve(self, body=True)

            def do_HEAD(self):
                hub._serve(self, body=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def fetched(self) -> list[str]:
        """The files whose contents were sent (GET of /ORG/NAME/resolve/REV/PATH)."""
        return sorted(
            unquote(p.split("/resolve/", 1)[1].split("/", 1)[1])
            for m, p, _ in self.requests
            if m == "GET" and "/resolve/" in p
        )

    def _serve(self, handler, body: bool):
        path = urlsplit(handler.path).path
        auth = handler.headers.get("Authorization")
        self.requests.append((handler.command, path, auth))
        route = (
            re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path)
            or re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path)
            or re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        )
        if route is None:
            return self._send(handler, 404, {"error": "not found"}, body, {"X-Error-Code": "EntryNotFound"})
        repo_id, revision = route.group(1), unquote(route.group(2))
        repo = self.repos.get(repo_id)
        if repo is None or (repo.token is not None and auth != f"Bearer {repo.token}"):
            return self._send(
                handler,
                404 if repo is None else 401,
                {"error": "Repository not found"},
                body,
                {"X-Error-Code": "RepoNotFound"},
            )
        found = repo.revision(revision)
        if found is None:
            return self._send(
                handler, 404, {"error": f"Invalid rev id: {revision}"}, body, {"X-Error-Code": "RevisionNotFound"}
            )
        commit, files = found
        if "/revision/" in path:
            return self._send(
                handler,
                200,
                {
                    "id": repo_id,
                    "sha": commit,
                    "private": repo.token is not None,
                    "siblings": [{"rfilename": f} for f in files],
                },
                body,
            )
        if "/tree/" in path:
            return self._send(
                handler,
                200,
                [
                    {"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for f, data in files.items()
                ],
                body,
            )
        name = unquote(route.group(3))
        if name not in files:
            return self._send(handler, 404, {"error": "Entry not found"}, body, {"X-Error-Code": "EntryNotFound"})
        data = files[name]
        headers = {
            "X-Repo-Commit": commit,
            "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
            "Content-Type": "application/octet-stream",
        }
        self._send(handler, 200, data, body, headers)

    @staticmethod
    def _send(handler, status: int, payload, body: bool, headers: dict | None = None):
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        handler.send_response(status)
        for key, value in {
            "Content-Length": str(len(data)),
            "Content-Type": "application/json",
            **(headers or {}),
        }.items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(data)
