"""Capacity planning: measured step costs (`profile`), a simulator of pdserve driven by them
(`sim`), and the search over pool shapes that predicts goodput at an SLO (`plan`)."""
