// MathJax 2 (served from assets/mathjax/, no network): typesets the \( \) and \[ \] spans that
// pymdownx.arithmatex (generic mode) writes, and nothing else on the page. The combined configuration file holds
// the TeX input and the HTML-CSS output; its STIX web fonts are served from the same folder.
window.MathJax = {
  config: ["TeX-AMS-MML_HTMLorMML-full.js"],
  tex2jax: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: false,
    ignoreClass: ".*",
    processClass: "arithmatex"
  },
  "HTML-CSS": { availableFonts: [], preferredFont: null, webFont: "STIX-Web", linebreaks: { automatic: true } },
  showMathMenu: false,
  messageStyle: "none"
};
