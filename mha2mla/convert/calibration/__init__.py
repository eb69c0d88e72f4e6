"""The calibration stream: calibration tokens carried through the layers, and the statistics taken at each."""
