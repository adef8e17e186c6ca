"""The course's aids, used only by the notebooks: experiments, timelines, the demo."""
