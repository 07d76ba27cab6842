"""plain.py with kubetrain's Hugging Face Trainer integration: two lines more.

KubetrainCallback reports step, loss, eval loss, learning rate and each committed checkpoint to the job
(`kubetrain status`, the operator's status and metrics), writes the heartbeats hang detection reads,
commits every checkpoint-N once all ranks wrote it, and turns SIGTERM into a checkpoint and exit 143.
resume_checkpoint() picks the newest committed checkpoint-N (never one cut off by a kill) and reports it
as status.resumedFromStep.

    python train.py [--max-steps 40] [--save-steps 10] [--eval-steps 20] [--data DIR]
"""

from __future__ import annotations

from plain import build_trainer, parse_args  # the script beside this one

from kubetrain.integrations.transformers import KubetrainCallback, resume_checkpoint


def main() -> None:
    args = parse_args()
    trainer = build_trainer(args, callbacks=[KubetrainCallback()])
    trainer.train(resume_from_checkpoint=resume_checkpoint(args.output_dir))


if __name__ == "__main__":
    main()
