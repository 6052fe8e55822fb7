"""The engine's queue serves URGENT pieces (differential batches) before BULK pieces (full
checkpoints) already waiting, and keeps FIFO order within a priority."""
import threading

import fastio
from fastio._engine import PieceQueue


def test_urgent_pieces_overtake_queued_bulk_pieces():
    queue = PieceQueue()
    queue.put_many(fastio.BULK, ["bulk-0", "bulk-1", "bulk-2"])
    queue.put_many(fastio.URGENT, ["urgent-0", "urgent-1"])
    queue.put_many(fastio.BULK, ["bulk-3"])
    order = [queue.get(block=False) for _ in range(6)]
    assert order == ["urgent-0", "urgent-1", "bulk-0", "bulk-1", "bulk-2", "bulk-3"]
    assert queue.get(block=False) is None


def test_closed_queue_releases_a_blocked_consumer():
    queue = PieceQueue()
    got = []
    consumer = threading.Thread(target=lambda: got.append(queue.get()))
    consumer.start()
    queue.close()
    consumer.join(timeout=10)
    assert not consumer.is_alive() and got == [None]


def test_large_requests_are_split_into_chunks_that_all_complete(tmp_path):
    config = fastio.FastioConfig(backend="pwrite", chunk_bytes=4096, threads=2)
    engine = fastio.make_engine(config)
    try:
        data = bytes(range(256)) * 64  # 16 KiB -> 4 pieces
        with fastio.Writer(tmp_path / "f", config, engine=engine) as writer:
            writer.write(data)
        assert (tmp_path / "f").read_bytes() == data
    finally:
        engine.close()
