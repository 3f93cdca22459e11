"""Building on the meta device and materialising only this rank's part: what ``configure_model`` computed is
recorded (``recorder.py``) and replayed tensor by tensor, straight into the tensors a strategy keeps
(``materialise.py``)."""
