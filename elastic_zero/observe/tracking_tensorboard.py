"""The TensorBoard tracker (observe/tracking.py): event files written with tensorboard's own writer
and protos (no torch in the coordinator), scalars by step, the spec as text. A job that goes on
(a restarted coordinator, a relaunch) writes a new event file into the same directory, which
TensorBoard reads as one run."""

from __future__ import annotations

import json
import os
import shutil
import time


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, log_dir: str, params: dict) -> None:
        self.log_dir, self.params = log_dir, params
        self.writer = None

    def start(self) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        os.makedirs(self.log_dir, exist_ok=True)
        self.writer = EventFileWriter(self.log_dir)
        self._write_text(0, "spec", "\n".join(f"{k} = {v}" for k, v in sorted(self.params.items())))

    def metrics(self, points: list[tuple[str, float, int]]) -> None:
        for key, value, step in points:
            self._write(step, tag=key, simple_value=float(value))
        self.writer.flush()

    def finish(self, summary_path: str, plot_path: str | None, ok: bool) -> None:
        with open(summary_path) as fh:  # the summary's figures as text beside the scalars
            summary = json.load(fh)
        shown = {k: summary.get(k) for k in ("ok", "error", "steps", "final_loss", "final_eval", "recoveries",
                                             "reconfigurations", "world_size_history")}
        self._write_text(summary.get("steps") or 0, "summary", json.dumps(shown, indent=1))
        if plot_path and os.path.exists(plot_path):
            shutil.copy(plot_path, os.path.join(self.log_dir, os.path.basename(plot_path)))
        self.writer.close()

    def abandon(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _write_text(self, step: int, tag: str, text: str) -> None:
        """Text for TensorBoard's text plugin, as a Markdown code block (indented four spaces)."""
        from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto

        metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        block = "\n".join("    " + line for line in text.splitlines())
        string = 7  # DT_STRING, TensorFlow's string dtype
        self._write(step, tag=tag, metadata=metadata, tensor=TensorProto(dtype=string, string_val=[block.encode()]))

    def _write(self, step: int, **value) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(**value)])
        self.writer.add_event(Event(wall_time=time.time(), step=int(step), summary=summary))
