"""The bundled trainer: DeepSpeed ZeRO-3 on every node, exact resume, atomic async checkpoints.

Launch (one line per node; `supervise` turns the trainer's own exit code into the process's):

    python -m skyspot.trainer.supervise --run-dir DIR -- \\
        torchrun --nproc_per_node 2 -m skyspot.trainer tiny --run-dir DIR train.steps=40

Modules, one concept each, in the order a start goes through them:

    loop         setup, resume, loop, save, cleanup (the entry point, `python -m skyspot.trainer`)
    phases       what a start holds, typed by phase: after setup, after build, while training
    process_env  the start's environment, set once and read into a frozen record; the tie to torchrun
    resume       the recipe reconciled with the checkpoint, data source, held-out set, LR schedule
    vote         the step boundary's vote: one all-gather of each rank's ballot
    notice_window  training through a notice's window, and how the window was spent
    say          the diagnostics line (stderr)
    cluster      where this process runs: SkyPilot's and torchrun's variables
    rundir       the run root's layout (DIR and the store), run.json, the attempt counter, the lock, --fresh
    base         where the base model's files are on this node (local, earlier fetch, store copy, hub)
    model        the model under zero.Init (pretrained weights copied in by rank 0, or an inline
                 config), LoRA through peft, tokenizers (Hugging Face, or the byte tokenizer)
    data         sources, formats (text, alpaca, chat) with loss masks, packing or padding, and
                 the deterministic resumable sample order
    engine       the DeepSpeed config and engine built from a recipe
    determinism  threads, seeds, RNG capture/restore, and what makes resume bitwise exact
    checkpoint   the checkpoint manager: when, where, what to resume from, retention, hooks
    snapshot     the in-memory snapshot (the only part of a save the loop waits for)
    writer       the background writer and the commit protocol
    manifest     the checkpoint layout (names, step pattern, hash) and what makes a directory a checkpoint
    preemption   SIGTERM/SIGUSR1/notices -> a flag the ranks agree on at each step boundary
    durable      the store tier from the trainer's side: start-up probe, resume source, deadlines
    remote       checkpoints in the store, read side: which are durable, download and verify
    uploader     the upload worker: committed checkpoints and event files to the store, retention
    export       final/: a Hugging Face model directory with its tokenizer (LoRA: the adapter, and merged/)
    exit_codes   the exit codes and the exit record the supervisor reads
    supervise    runs torchrun and exits with the trainer's code
    faults       test-only fault injection points (inert unless SKYSPOT_FAULT is set)

Import-light: nothing here imports torch until a module that needs it is imported.
"""
