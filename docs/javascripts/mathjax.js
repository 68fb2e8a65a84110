window.MathJax = {
  tex: {
    // \( \) and \[ \] from pymdownx.arithmatex; $ $ and $$ $$ in the notebooks' markdown cells
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    processEnvironments: true
  },
  options: {
    // the whole page (code and pre are skipped): the notebooks' markdown cells hold bare $ ... $
    ignoreHtmlClass: "tex2jax_ignore",
    processHtmlClass: "arithmatex"
  }
};

document$.subscribe(() => {
  MathJax.startup.output.clearCache()
  MathJax.typesetClear()
  MathJax.texReset()
  MathJax.typesetPromise()
})
