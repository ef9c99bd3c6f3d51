"""Each optional capability of a seam is a Protocol its implementations are checked against, not a getattr probe.

The pipeline, the servicer and the store test a collaborator with isinstance
against these Protocols, so a method renamed on one side would turn a
capability off without an error. These pin which implementation offers what.
"""

from __future__ import annotations

from checkpointd.bundle.sink import BundleSink
from checkpointd.core import ports
from checkpointd.saves.bases import Incremental
from checkpointd.saves.sinks import AtWriterPriority
from checkpointd.storage.local import LocalStore
from checkpointd.storage.s3 import S3Leases, S3Store


def test_the_bundle_sink_offers_every_sink_capability() -> None:
    for capability in (
        ports.WatchedSink,
        ports.ReferencingSink,
        ports.WholePartsSink,
        ports.OrderedSink,
        ports.CopyingSink,
    ):
        assert issubclass(BundleSink, capability), capability.__name__
    assert not issubclass(BundleSink, ports.SameChunksSink)  # only a save offered a base takes SameChunks


def test_the_pipelines_sinks_pass_on_what_an_incremental_save_needs() -> None:
    assert issubclass(AtWriterPriority, ports.CopyingSink)
    assert issubclass(AtWriterPriority, ports.OrderedSink)
    assert issubclass(Incremental, ports.SameChunksSink)
    assert issubclass(Incremental, ports.WholePartsSink)


def test_the_object_store_streams_offers_bases_and_lends_copies_the_local_store_does_not() -> None:
    for capability in (ports.StreamingStore, ports.RemoteBases, ports.LocalCopies, ports.SaveFiles, ports.StagesFiles):
        assert issubclass(S3Store, capability), capability.__name__
    assert issubclass(S3Store, ports.Closing) and issubclass(LocalStore, ports.Closing)
    assert not issubclass(LocalStore, ports.StreamingStore)
    assert not issubclass(LocalStore, ports.RemoteBases)
    # The local store lends Restore a save's dir held open instead (read following no link).
    assert issubclass(LocalStore, ports.HeldSaves) and not issubclass(S3Store, ports.HeldSaves)


def test_a_fleets_leases_describe_themselves_and_list_holders_at_once() -> None:
    assert issubclass(S3Leases, ports.Described) and issubclass(S3Leases, ports.LeaseHolders)
    assert not issubclass(ports.NoLeases, ports.Described)
    assert not issubclass(ports.NoLeases, ports.LeaseHolders)
