"""Checkpoints that never lose work: save, rotate, find the latest, validate and resume.

Layout of an output folder::

    DIR/checkpoint-<global step>/   one complete checkpoint
        effitrain.json              written by effitrain, readable without torch (see below)
        model.safetensors           \
        optimizer.bin                |  accelerator.save_state: model, optimizer, scheduler,
        scheduler.bin                |  RNG states of every process
        random_states_<rank>.pkl    /
    DIR/final/                      save_pretrained model + tokenizer at the end of training
                                    (with --lora-rank: the adapters, peft's save_pretrained)
    DIR/final-merged/               --lora-merge: the adapters merged into the base model
    DIR/.tmp-checkpoint-<step>/     a save in progress (or left over from a crash): ignored
    DIR/.effitrain.lock             the run that owns DIR now (:mod:`.lock`): one at a time

A save writes everything into ``.tmp-checkpoint-<step>``, fsyncs it, and only then renames it to
``checkpoint-<step>`` (``os.replace``: atomic on one file system). Old checkpoints are deleted
only after that rename, and never the newest complete one. Accelerate's own ``save_state``
rotates *before* writing and writes in place, which is why it is not called on the final folder.

``effitrain.json`` lists every file of the checkpoint with its size, so a folder that was copied
half-way or truncated is recognised as incomplete without reading any tensor.

Every process calls :func:`save_checkpoint` (each writes its own RNG state); only the main
process creates, renames and deletes folders, with barriers in between.

A resume trusts nothing it has not checked (:mod:`.resume`): the folder's step against its
metadata's, the optimizer and options against this run's, the lr schedule, and, once loaded,
the steps the scheduler and the optimizer counted; it names every checkpoint it skipped and an
RNG state it cannot restore. ``final/`` carries the step it holds, and is never replaced by an
earlier model (:func:`check_final`). The modules: :mod:`.metadata` (``effitrain.json``,
finding checkpoints), :mod:`.saving`, :mod:`.resume`, :mod:`.policy` (when the loop saves).
"""

from effitrain.checkpoint.lock import LOCK_FILE, output_lock
from effitrain.checkpoint.metadata import (
    CHECKPOINT_PREFIX,
    FINAL_DIR,
    METADATA_FILE,
    METADATA_FORMAT,
    METADATA_VERSION,
    TMP_PREFIX,
    TRASH_PREFIX,
    build_metadata,
    checkpoint_step,
    complete_checkpoints,
    find_latest,
    incomplete,
    is_complete,
    latest,
    library_versions,
    list_checkpoints,
    param_group_hyperparameters,
    read_metadata,
    step_counters,
)
from effitrain.checkpoint.policy import Checkpointer, CheckpointPolicy
from effitrain.checkpoint.resume import (
    RUN_ONLY_OPTIONS,
    check_counters,
    check_layout,
    check_resumable,
    check_schedule,
    check_step,
    config_differences,
    continue_schedule,
    continued_config,
    load_checkpoint,
    random_state_problem,
    resolve_resume,
    resume_command,
)
from effitrain.checkpoint.saving import (
    check_final,
    clean_leftovers,
    final_step,
    rotate,
    save_checkpoint,
    save_final,
    write_failure,
)

__all__ = [
    "CHECKPOINT_PREFIX",
    "FINAL_DIR",
    "LOCK_FILE",
    "METADATA_FILE",
    "METADATA_FORMAT",
    "METADATA_VERSION",
    "RUN_ONLY_OPTIONS",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "CheckpointPolicy",
    "Checkpointer",
    "build_metadata",
    "check_counters",
    "check_final",
    "check_layout",
    "check_resumable",
    "check_schedule",
    "check_step",
    "checkpoint_step",
    "clean_leftovers",
    "complete_checkpoints",
    "config_differences",
    "continue_schedule",
    "continued_config",
    "final_step",
    "find_latest",
    "incomplete",
    "is_complete",
    "latest",
    "library_versions",
    "list_checkpoints",
    "load_checkpoint",
    "output_lock",
    "param_group_hyperparameters",
    "random_state_problem",
    "read_metadata",
    "resolve_resume",
    "resume_command",
    "rotate",
    "save_checkpoint",
    "save_final",
    "step_counters",
    "write_failure",
]
