"""ShapesWorld's programs: the shipped models' pretraining scripts (`pretrain_t2i`, `pretrain_vlm`,
`pretrain_video`), probes (`vlm_probe`, `video_probe`, `direction_probe`) and reports (`vqa_report`, `rl_report`), each run as
`python -m mmgrpo_shapes.programs.NAME`, the `mmgrpo pretrain` command (`cli`), and `t2i_data`, the scenes and
prompts `pretrain_t2i` trains and evaluates on.

They sit on the pipelines (a layer above the world in `mmgrpo_shapes`); nothing below them imports them.
"""
