"""Reading torch.distributed.checkpoint (DCP) folders from anyone: no pickle in them runs code.

DCP pickles its `.metadata` and the non-tensor items of a state dict (the optimizer's hyper-parameters), and its
reader unpickles both without restriction, so a crafted folder would run code when opened. Here the metadata is
unpickled with only DCP's own record classes allowed, and every non-tensor item with `torch.load(weights_only=True)`;
anything else is refused with an `UnpicklingError` naming what it asked for. The metadata and every storage file it
names must be regular files inside the checkpoint's folder (`lingua.files.safe.regular_file`), checked before any is
opened: a crafted path never reads another run's shards, nor blocks on a FIFO.
"""

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from lingua.files.safe import regular_file

# Every global a `.metadata` written by torch 2.13 refers to (besides the dtypes).
METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # where each item lies in which file
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a name to a torch.layout
    ("pathlib", "PosixPath"),  # the folder the checkpoint was saved in
}


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records, dtypes and sizes; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in METADATA_GLOBALS and not dtype:
            raise pickle.UnpicklingError(f"refused {module}.{name}: DCP metadata holds only DCP's own records")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata unpickled by `MetadataUnpickler`, and its files checked."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = regular_file(self._get_metadata_path(kwargs.get("rank")), inside=self.path)
        with self.fs.create_stream(path, "rb") as file:
            metadata = MetadataUnpickler(file).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not DCP metadata")
        self._check_storage_files(metadata.storage_data)
        if metadata.storage_meta is None:  # what FileSystemReader.read_metadata does too
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check_storage_files(self, storage: Any) -> None:
        """Every file `read_data` will open (`relative_path` joined to the folder) is a regular file in it."""
        infos = storage.values() if isinstance(storage, dict) else [storage]
        if not all(isinstance(info, _StorageInfo) and isinstance(info.relative_path, str) for info in infos):
            raise pickle.UnpicklingError("its storage_data does not name a file for every item")
        for name in sorted({info.relative_path for info in infos}):
            regular_file(self.fs.concat_path(self.path, name), inside=self.path)


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor items unpickled by `torch.load(weights_only=True)` (DCP's own
    uses weights_only=False); the rest of `load_bytes` is DefaultLoadPlanner's."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            item = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(f"item {fqn} is not plain data ({_refused_global(e)})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], item)
        else:
            self.state_dict[fqn] = item


def _refused_global(error: pickle.UnpicklingError) -> str:
    """What torch's weights-only refusal names (its message is a page of advice)."""
    found = re.search(r"GLOBAL (\S+)", str(error))
    return f"refused {found[1]}" if found else "refused by torch.load(weights_only=True)"


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    return SafeReader(path).read_metadata()


def load(state: dict, path: Path) -> None:
    """`dcp.load` of `state` in place from the checkpoint folder `path`, without unpickling anything unsafe."""
    dcp.load(state, storage_reader=SafeReader(path), planner=WeightsOnlyPlanner())
