"""A model argument that is a valid Hub id, not a local path and not in the cache: the Hub is asked once, without
retries, so a machine without a network (or a mistyped local name) gets its one-line error at once, and a
repository that does not exist is named as such."""

from __future__ import annotations

import socket
import threading

import pytest
from hub_server import hub_server  # noqa: F401  (fixture)

from relational_hf.commands.main import main
from relational_hf.loading import (
    ModelSourceNotFound,
    ModelSourceOffline,
    check_model_argument,
    resolve_model_source,
)


class _HangUp:
    """A TCP server on 127.0.0.1 that accepts every connection and closes it at once, counting them: an endpoint
    that cannot answer an HTTP request."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def unreachable_hub(monkeypatch):
    from huggingface_hub import close_session, constants

    server = _HangUp()
    # huggingface_hub builds its file URLs from a template made from HF_ENDPOINT at import: both are pointed here
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    close_session()
    try:
        yield server
    finally:
        close_session()
        server.close()


def test_unreachable_hub_is_reported_after_one_request(unreachable_hub, capsys):
    with pytest.raises(ModelSourceOffline, match="the Hub cannot be reached"):
        resolve_model_source("relational-hf-tests/not-cached")
    assert unreachable_hub.connections == 1  # no retries with backoff
    # through a command: one line on stderr, no traceback and none of the download's retry warnings
    capsys.readouterr()
    assert main(["redundancy", "not-a-folder-here", "--meta"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not-a-folder-here: not a local path" in err[0] and "cannot be reached" in err[0], err
    assert unreachable_hub.connections == 2
    # a tokenizer given by Hub id (finetune --tokenizer) is asked for once too
    with pytest.raises(ModelSourceOffline, match="^--tokenizer: .*cannot be reached"):
        check_model_argument("some-org/some-tokenizer", "--tokenizer", model=False)
    assert unreachable_hub.connections == 3


def test_missing_hub_repository_is_named(hub_server):  # noqa: F811
    with pytest.raises(ModelSourceNotFound, match="no Hub repository of that name"):
        resolve_model_source("test-user/no-such-model")
    with pytest.raises(ModelSourceNotFound, match="^--tokenizer: test-user/no-such-tokenizer: .*no Hub repository"):
        check_model_argument("test-user/no-such-tokenizer", "--tokenizer", model=False)


def test_existing_hub_repository_resolves(hub_server, tmp_path):  # noqa: F811
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo("test-user/tiny-config")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    api.upload_file(path_or_fileobj=str(tmp_path / "config.json"), path_in_repo="config.json", repo_id="test-user/tiny-config")
    source = resolve_model_source("test-user/tiny-config")
    assert source.location == "test-user/tiny-config" and not source.local
    # a repository without the file asked for is left to the download, which names the file
    assert not resolve_model_source("test-user/tiny-config", "model.Q4_0.gguf").local
