"""Checkpoints: what a run keeps on disk to resume and to export, in two halves.

The format half needs no torch: a checkpoint directory's names, manifest, verification, discovery and
retention (manifest.py), where a `--resume` starts and what it may change (resume.py), and what an export
holds beside the weights (export_files.py). The job reads them before any rank starts.

The torch half: each rank's shards saved and loaded with torch.distributed.checkpoint (saver.py), its RNG
states (rng.py), the start-up check that every rank sees one run directory (rundir.py), and a checkpoint's
model written as a Hugging Face directory (export.py). It saves the runtime's parts, so the package sits
above the runtime, which never reads a checkpoint (docs/design.md, section 9).
"""
