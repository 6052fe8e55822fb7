"""The striped layout of a full checkpoint's payload and its fields (docs/format.md, "Striped full
checkpoints"): where each unit goes, and that an index or manifest whose stripes do not describe
the layout is refused as damage, naming the file."""
from __future__ import annotations

import pytest

from lowdiff.errors import CorruptCheckpointError
from lowdiff.format.container import FullEntry, ManifestRecord, RetiredEntry
from lowdiff.format.schema import FullIndex, Section, Stripe, stripe_pieces, stripe_sizes
from lowdiff.store.stripes import stripe_count, stripe_unit

PAGE = 4096


def test_the_layout_puts_unit_i_on_device_i_mod_n():
    assert stripe_sizes(10 * PAGE, PAGE, 4) == [3 * PAGE, 3 * PAGE, 2 * PAGE, 2 * PAGE]
    assert stripe_sizes(9 * PAGE + 512, PAGE, 4) == [3 * PAGE, 2 * PAGE + 512, 2 * PAGE, 2 * PAGE]
    assert stripe_pieces(PAGE, 3, PAGE // 2, 5 * PAGE) == [
        (0, PAGE // 2, PAGE // 2, PAGE // 2), (1, 0, PAGE, PAGE), (2, 0, 2 * PAGE, PAGE),
        (0, PAGE, 3 * PAGE, PAGE), (1, PAGE, 4 * PAGE, PAGE)]
    assert stripe_unit(64 << 20, 4) == 1 << 20 and stripe_count(64 << 20, 4, 1 << 20) == 4
    assert stripe_unit(10 * PAGE, 3) == 4 * PAGE and stripe_count(10 * PAGE, 3, 4 * PAGE) == 3
    assert stripe_unit(PAGE, 4) == PAGE and stripe_count(PAGE, 4, PAGE) == 1


def test_every_payload_byte_is_in_exactly_one_place():
    unit, count, payload = 3 * PAGE, 4, 29 * PAGE
    places, positions = set(), []
    for device, at, position, nbytes in stripe_pieces(unit, count, 0, payload):
        for k in range(0, nbytes, PAGE):
            places.add((device, at + k))
            positions.append(position + k)
        assert at + nbytes <= stripe_sizes(payload, unit, count)[device]
    assert positions == list(range(0, payload, PAGE)) and len(places) == payload // PAGE
    assert sum(stripe_sizes(payload, unit, count)) == payload


def _index(stripes, unit, payload_bytes=8 * PAGE):
    objects = Section(PAGE if stripes else PAGE + payload_bytes, 10, crc32c=0)   # after the payload in the file
    return FullIndex(3, "0a1b2c3d", "0123456789abcdef", payload_bytes, (), objects, (), {},
                     "torch.optim.SGD", "Dense()", stripes=stripes, stripe_bytes=unit).to_json()


def _stripes(sizes):
    return tuple(Stripe(None if k == 0 else f"/mnt/d{k}", f"full-000000000003-0a1b2c3d-s{k:02d}.lds", n, 7)
                 for k, n in enumerate(sizes))


def test_an_index_with_stripes_reads_back():
    stripes = _stripes(stripe_sizes(8 * PAGE, PAGE, 3))
    index = FullIndex.from_json("f.ldf", _index(stripes, PAGE), PAGE + 10 + 100)
    assert index.stripes == stripes and index.stripe_bytes == PAGE
    unstriped = FullIndex.from_json("f.ldf", _index((), 0), PAGE + 8 * PAGE + 10 + 100)
    assert "stripes" not in _index((), 0) and unstriped.stripes == ()


@pytest.mark.parametrize("change, problem", [
    (lambda j: j["stripes"][1].update(nbytes=PAGE), "the layout gives it"),
    (lambda j: j.update(stripe_bytes=1000), "do not lay out"),
    (lambda j: j["stripes"][2].update(dir="relative/dir"), "absolute directory"),
    (lambda j: j["stripes"][0].update(file="../x"), "plain name"),
    (lambda j: j.pop("stripe_bytes"), "stripe_bytes"),
])
def test_stripes_that_do_not_describe_the_layout_are_damage(change, problem):
    obj = _index(_stripes(stripe_sizes(8 * PAGE, PAGE, 3)), PAGE)
    change(obj)
    with pytest.raises(CorruptCheckpointError, match=problem):
        FullIndex.from_json("f.ldf", obj, PAGE + 10 + 100)


def test_a_manifest_names_stripes_only_for_striped_checkpoints():
    stripes = _stripes([PAGE, PAGE])
    manifest = ManifestRecord([FullEntry(3, "full-000000000003-0a1b2c3d.ldf", 100, "0a1b2c3d", stripes),
                               FullEntry(6, "full-000000000006-0a1b2c3d.ldf", 100, "0a1b2c3d")], [], "0123456789abcdef",
                              [RetiredEntry("full-000000000000-0a1b2c3d.ldf", 50, stripes)])
    data = manifest.to_json()
    assert data.count(b'"stripes"') == 2
    again = ManifestRecord.from_json(data, "MANIFEST.json")
    assert again.fulls == manifest.fulls and again.retired == manifest.retired
