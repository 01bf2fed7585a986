"""A Hugging Face Hub on the loopback, serving repositories made of local folders, for the tests of
Hub ids (tests/run/test_hub.py): no test reaches the network.

Why a mirror rather than a cache laid out by hand: huggingface_hub (checked on 2.4.0) then runs its
real download path, the one a first run takes (the revision resolved by the Hub, the file listing,
each file's metadata and its bytes, written into the cache's blobs/, snapshots/ and refs/), and the
refusals come from the HTTP answers the Hub gives (its X-Error-Code headers), so the tests see the
errors huggingface_hub raises for them; the offline tests then read the cache that download wrote.
``requests`` records every request, so a test can count the downloads of each file.

It answers the calls huggingface_hub makes to fetch a repository, for models and datasets alike:
``GET /api/{models,datasets}/ID/revision/REV`` (the commit), ``GET .../tree/REV`` (the files),
``HEAD`` and ``GET /[datasets/]ID/resolve/REV/PATH`` (a file's metadata and bytes). A repository may
be gated (its files need a token) or private (everything needs one: HF_TOKEN).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]  # path in the repository -> content
    commits: dict[str, str] = field(default_factory=dict)  # branch -> commit
    gated: bool = False
    private: bool = False


def _blob_id(content: bytes) -> str:
    """git's id of a blob, which the Hub gives as a file's oid and ETag."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class HubMirror:
    """``with HubMirror() as hub: hub.add("model", "owner/name", folder); ...hub.url...``"""

    TOKEN = "hf_mirror_token"  # the token a gated or private repository takes

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                mirror._answer(self, body=True)

            def do_HEAD(self):  # noqa: N802
                mirror._answer(self, body=False)

            def log_message(self, *args):  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HubMirror:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(
        self,
        kind: str,
        repo_id: str,
        folder: Path,
        branch: str = "main",
        gated: bool = False,
        private: bool = False,
    ) -> str:
        """Serve every file under ``folder`` as ``repo_id`` (a "model" or a "dataset") at
        ``branch``; returns the branch's commit. A repository added again at another branch keeps
        its files: a branch is a name for a commit, and every commit serves the same files."""
        files = {
            p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }
        repo = self.repos.setdefault((kind, repo_id), Repo(files, gated=gated, private=private))
        repo.files = files
        digest = hashlib.sha1(json.dumps([repo_id, branch, sorted(files)]).encode())
        repo.commits[branch] = digest.hexdigest()
        return repo.commits[branch]

    def downloads(self, repo_id: str, file: str) -> int:
        """How many times the repository ``repo_id`` sent its file ``file`` (GET), at any
        revision."""
        return sum(
            method == "GET"
            and path.removeprefix("/datasets").startswith(f"/{repo_id}/resolve/")
            and path.split("/resolve/", 1)[1].split("/", 1)[1] == file
            for method, path in self.requests
        )

    # ------------------------------------------------------------------------------------ answers

    def _answer(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(request.path).path)
        self.requests.append((request.command, path))
        authorized = request.headers.get("authorization") == f"Bearer {self.TOKEN}"
        found = self._route(path)
        if found is None:
            return self._send(request, 404, b"", {"X-Error-Code": "RepoNotFound"}, body)
        kind, repo_id, what, revision, file = found
        repo = self.repos.get((kind, repo_id))
        if repo is None or (repo.private and not authorized):
            return self._send(request, 401, b"", {"X-Error-Code": "RepoNotFound"}, body)
        commit = repo.commits.get(revision, revision if revision in repo.commits.values() else None)
        if commit is None:
            return self._send(request, 404, b"", {"X-Error-Code": "RevisionNotFound"}, body)
        if what == "revision":
            info = {
                "id": repo_id,
                "sha": commit,
                "private": repo.private,
                "gated": "manual" if repo.gated else False,
                "siblings": [{"rfilename": name} for name in repo.files],
            }
            return self._send(request, 200, json.dumps(info).encode(), {}, body)
        if what == "tree":
            tree = [
                {"type": "file", "oid": _blob_id(data), "size": len(data), "path": name}
                for name, data in repo.files.items()
            ]
            return self._send(request, 200, json.dumps(tree).encode(), {}, body)
        return self._file(request, repo, commit, file, authorized, body)

    def _file(self, request, repo: Repo, commit: str, file: str, authorized: bool, body: bool):
        headers = {"X-Repo-Commit": commit}
        if repo.gated and not authorized:
            headers["X-Error-Code"] = "GatedRepo"
            headers["X-Error-Message"] = "Access to this model is restricted: accept its conditions"
            return self._send(request, 401, b"", headers, body)
        if file not in repo.files:
            headers["X-Error-Code"] = "EntryNotFound"
            return self._send(request, 404, b"", headers, body)
        data = repo.files[file]
        headers["ETag"] = f'"{_blob_id(data)}"'
        return self._send(request, 200, data, headers, body)

    @staticmethod
    def _route(path: str) -> tuple[str, str, str, str, str] | None:
        """(kind, repo id, "revision" / "tree" / "resolve", revision, file) of a request's path."""
        parts = path.strip("/").split("/")
        if parts[:1] == ["api"] and len(parts) >= 6 and parts[1] in ("models", "datasets"):
            kind, repo_id, what, revision = parts[1][:-1], "/".join(parts[2:4]), parts[4], parts[5]
            return (kind, repo_id, what, revision, "") if what in ("revision", "tree") else None
        kind = "dataset" if parts[:1] == ["datasets"] else "model"
        parts = parts[1:] if kind == "dataset" else parts
        if len(parts) >= 5 and parts[2] == "resolve":
            return kind, "/".join(parts[:2]), "resolve", parts[3], "/".join(parts[4:])
        return None

    @staticmethod
    def _send(request, status: int, data: bytes, headers: dict, body: bool) -> None:
        request.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            request.send_header(key, value)
        if status == 200 and not request.path.startswith("/api/"):
            request.send_header("Content-Type", "application/octet-stream")
        elif status == 200:
            request.send_header("Content-Type", "application/json")
        request.end_headers()
        if body:
            request.wfile.write(data)
