"""`connect_endpoint`: the ingress's tokenizer comes from its own node, never from the path a
replica reports (which may exist only on the replica's node), and must match the replica's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from actors.messages import ReplicaInfo
from actors.model_endpoint import TokenizerMismatchError, cluster_cache, connect_endpoint
from actors.token_channel import ChannelServer
from demo.paths import ModelNotFoundError
from engine.tokenizer import load_tokenizer, tokenizer_digest
from tests.actors.helpers import small_config
from tests.engine.tokenizer_fixture import build_sentencepiece_tokenizer, build_tokenizer


class InfoHandle:
    """A ModelReplica handle whose `info.remote()` answers `info`."""

    def __init__(self, info: ReplicaInfo) -> None:
        self._info = info

    def options(self, **_: Any) -> InfoHandle:
        return self

    @property
    def info(self) -> InfoHandle:
        return self

    async def remote(self) -> ReplicaInfo:
        return self._info


def saved(tokenizer: Any, directory: Path) -> Path:
    tokenizer.save_pretrained(directory)
    return directory


def replica_info(digest: str) -> ReplicaInfo:
    # a path only the replica's node has: reading it here would fail
    return ReplicaInfo("replica-1", "demo", "/only/on/the/replica/node/demo", 2048, digest)


@pytest.fixture
def stopped_channels(monkeypatch) -> list[ChannelServer]:
    """Every ChannelServer stopped during the test."""
    stopped: list[ChannelServer] = []
    stop = ChannelServer.stop

    async def record(self: ChannelServer) -> None:
        stopped.append(self)
        await stop(self)

    monkeypatch.setattr(ChannelServer, "stop", record)
    return stopped


async def test_the_tokenizer_loads_from_this_nodes_model_not_the_replicas_path(tmp_path):
    local = saved(build_tokenizer(), tmp_path / "here")
    asked: list[str] = []

    def resolve(name: str) -> Path:
        asked.append(name)
        return local

    config = small_config()
    digest = tokenizer_digest(load_tokenizer(local))
    client, endpoint = await connect_endpoint(
        config, InfoHandle(replica_info(digest)), "ing-1", cluster_cache(config), resolve
    )
    try:
        assert asked == [config.engine.model]
        assert endpoint.max_model_len == 2048
        text = "the order arrived late"
        assert endpoint.tokenizer.encode(text) == build_tokenizer().encode(text)
    finally:
        await client.close()


async def test_a_tokenizer_other_than_the_replicas_fails_and_releases_the_channel(
    tmp_path, stopped_channels
):
    local = saved(build_tokenizer(), tmp_path / "here")
    other = tokenizer_digest(build_sentencepiece_tokenizer())
    config = small_config()
    with pytest.raises(TokenizerMismatchError, match="every node"):
        await connect_endpoint(
            config, InfoHandle(replica_info(other)), "ing-1", cluster_cache(config), lambda _: local
        )
    assert len(stopped_channels) == 1


async def test_a_model_missing_on_this_node_fails_naming_the_node(stopped_channels):
    def resolve(name: str) -> Path:
        raise ModelNotFoundError(f"the {name!r} model is not built yet")

    config = small_config()
    with pytest.raises(ModelNotFoundError, match=r"engine\.model on this node .*not built yet"):
        await connect_endpoint(
            config, InfoHandle(replica_info("x")), "ing-1", cluster_cache(config), resolve
        )
    assert len(stopped_channels) == 1


def test_the_digest_tells_tokenizers_apart_and_survives_a_save(tmp_path):
    first = build_tokenizer()
    reloaded = load_tokenizer(saved(first, tmp_path / "t"))
    assert tokenizer_digest(reloaded) == tokenizer_digest(load_tokenizer(tmp_path / "t"))
    assert tokenizer_digest(reloaded) != tokenizer_digest(build_sentencepiece_tokenizer())
    reloaded.chat_template = "{{ messages }}"
    assert tokenizer_digest(reloaded) != tokenizer_digest(load_tokenizer(tmp_path / "t"))
