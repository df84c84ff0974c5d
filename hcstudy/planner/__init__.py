"""The planner: will a run fit on a GPU, which micro-batch, how long, what it costs.

    python train_c4.py --estimate --depth 48        # the size, the memory plan of one GPU and the time of one run
    bash run_experiments.sh --dry-run               # every job of the matrix planned for the node, wall time, cost

Never imports train_c4 (the trainer imports it): where a plan needs the model, the caller passes the model class
(train_c4.GPT) as `gpt`, and configs are train_c4.Config objects. Modules, each importing only those above it:
gpus (spec sheets), memory (the memory plan, the micro-batch), step_work (a step's kernels and bytes, counted),
run_time (the step and the run priced), estimate (--estimate's text), plan_jobs (--plan-jobs, the launcher's check).
docs/planning.md says how each term is derived, what is measured and what is assumed.
"""
