"""The reference engines that check the compiled ones: exact enumeration through Pyro
(``exact``, ``enumeration``), Gibbs through NumPyro (``gibbs``) and Pyro SVI (``svi``)."""
